"""The end-to-end acceptance: the real Megatron-DeepSpeed ``pretrain_gpt.py`` (unmodified,
``--no-pipeline-parallel``) with ZeRO-topo under tensor parallelism 2.

8 ranks emulating Frontier in miniature (2 nodes x 2 MI250X x 2 GCDs), TP 2 over each GCD pair, so
the data-parallel group (4) holds one GCD per MI250X and crosses the node; dense GPT, fp32, global
batch 4, 10 iterations, gradient_clipping 1.0, ``--use-cpu-initialization`` (both sides start from
the same weights, checked). examples/megatron_deepspeed_zero_topo.sh with ``FINAL_DUMP``
(tests/megatron_dump_final.py: each rank's parameters at ``deepspeed.initialize`` and at the end,
ZeRO-topo's read inside ``engine.ds_ext.gathered_parameters()``, and its last step's ledger; the
client's ``--save`` refuses ZeRO-topo under model parallelism). The reference is plain DeepSpeed
ZeRO-1 under the same TP through the same launcher without ds_ext.

* unquantized preset, the client's Adam: the printed lm losses equal ZeRO-1's; every parameter within
  1e-6 except the key third of each ``query_key_value.bias``: its exact gradient is zero (softmax is
  invariant to a shift of every key by the same vector), so its gradient is rounding noise, which
  Adam scales into steps; there both sides stay within 1e-5 of their initial values, and so of each other.
* unquantized preset, SGD with momentum (moves each parameter in proportion to its gradient): losses
  and every parameter, the key bias included, within 1e-6.
* both: ds_ext's ledger equals its analytic model on ZeRO-topo's levels; the only other bytes in
  forward / backward are Megatron's tensor-parallel all-reduces inside the GCD pair (torch.distributed
  collectives counted); the inter-node bytes of the gradient synchronisation are the data group's
  floor 2 (M_dp / P)(N - 1)/N (P = 2 of its ranks per node, N = 2) plus the 12-byte norm all-reduce;
  over the whole run (from ``deepspeed.initialize`` on), the ledger's bytes per level equal an
  independent count of every torch.distributed collective (tests/megatron_dump_final.py, TorchCount).
* default (quantized) preset: losses finite and falling, each within the largest distance between
  the ZeRO-1 run and a ZeRO-1 run with ``--seed 1235`` (other weights and data order); every parameter
  moves; ledger equals the analytic model, inter-node bytes at the floor of its (block-padded) shards.

Needs what the example script needs (examples/megatron_deepspeed_env.sh builds it and prints the
exports): ``MDS`` (a copy of the client with its data helpers built), ``DS0196`` (deepspeed 0.19.6,
which the client imports), ``EXTRA`` (nltk, pybind11, an import-only torchvision) and ``DATA`` (a
NullTokenizer dataset); skipped otherwise. Six runs of 8 ranks, 7 to 9 minutes in all on 2 shared cores: not
part of the quick suite's budget.

``-k fp16``, the pipeline form in fp16 against DeepSpeed ZeRO-1 fp16 with forced overflows
(three runs); ``-k recipe``, each of 004's Frontier recipes shrunk to 8 ranks by
examples/frontier_recipe_cpu.sh (five runs, shared by recipes that shrink to the same job).
"""

import math
import os
import subprocess
from pathlib import Path

import pytest
from clients import MDS_ENV, MDS_READY, MDS_SKIP, lm_log, lm_losses

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not MDS_READY, reason=MDS_SKIP)
SGD = ("--optimizer", "sgd", "--sgd-momentum", "0.9", "--lr", "0.1", "--min-lr", "0.01")
RANKS = 8


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``runs(name, mode, *args)``: (printed losses, each rank's dump), each run once per module."""
    import torch

    done = {}

    def run(
        name: str,
        mode: str,
        *args: str,
        pp: int | None = None,
        plugins: str | None = None,
        fp16: str | None = None,
        recipe: Path | None = None,
    ):
        """``fp16``: FP16 of the example script (its keys of the fp16 section): the printed log as
        :func:`clients.lm_log` reads it in place of the losses; ``recipe``: examples/frontier_recipe_cpu.sh
        RECIPE MODE in place of examples/megatron_deepspeed_zero_topo.sh MODE."""
        if name not in done:
            dump = tmp_path_factory.mktemp("run")
            env = {**os.environ, **MDS_ENV, "FINAL_DUMP": str(dump), **({"PP": str(pp)} if pp else {})}
            env |= ({"PLUGINS": plugins} if plugins else {}) | ({"FP16": fp16} if fp16 is not None else {})
            script = ["frontier_recipe_cpu.sh", str(recipe)] if recipe else ["megatron_deepspeed_zero_topo.sh"]
            proc = subprocess.run(
                ["bash", str(REPO / "examples" / script[0]), *script[1:], mode, *args],
                env=env,
                capture_output=True,
                text=True,
                timeout=900,
            )
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
            log = lm_log(proc.stdout) if fp16 is not None else lm_losses(proc.stdout)
            done[name] = (log, [torch.load(dump / f"rank{r}.pt") for r in range(RANKS)])
        return done[name]

    return run


def _key_bias(name: str, p):
    """The key third of a fused ``query_key_value.bias`` ([q | k | v] on each tensor rank), else None."""
    return p.view(3, -1)[1] if name.endswith("query_key_value.bias") else None


def _check_ledger(dump: dict, floor: bool) -> None:
    measured, analytic = dump["measured"], dump["analytic"]
    assert dump["ledger_total"] == dump["torch_total"]  # the whole run, per level: ds_ext's ledger = a count of its own
    for phase, levels in analytic.items():
        assert {lv: measured[phase].get(lv) for lv in levels} == levels, (phase, measured[phase])
    for (
        phase,
        levels,
    ) in measured.items():  # the rest: Megatron's TP all-reduces within the GCD pair, its own collectives
        extra = set(levels) - set(analytic.get(phase, {}))
        assert phase == "other" or extra <= ({"gcd"} if phase in ("forward", "backward") else set()), (phase, levels)
    if floor:
        node = sum(levels.get("node", 0) for phase, levels in measured.items() if phase != "other")
        norm = 2 * 8 * (4 - 1) / 4  # the grad-norm all-reduce over the 4 ranks of the data group
        assert node == 2 * (dump["padded_bytes"] / 2) * (2 - 1) / 2 + norm
    assert "tensor 2 (crosses gcd)" in dump["banner"] and "data 4 (crosses node)" in dump["banner"]


def _same_start(ref: list[dict], ours: list[dict]) -> None:
    import torch

    for r, o in zip(ref, ours):
        assert (r["tensor_rank"], r["data_rank"]) == (o["tensor_rank"], o["data_rank"])
        assert set(r["init"]) == set(o["init"]) == set(r["final"]) == set(o["final"])
        for name, p in r["init"].items():
            assert torch.equal(o["init"][name], p), name


def test_unquantized_equals_zero1_adam(runs):
    ref_losses, ref = runs("zero1", "zero1")
    losses, ours = runs("unquantized", "unquantized")
    assert losses == pytest.approx(ref_losses, rel=1e-6, abs=0)
    _same_start(ref, ours)
    _equal_under_adam(ref, ours)
    for o in ours:
        _check_ledger(o, floor=True)


def _equal_under_adam(ref: list[dict], ours: list[dict]) -> None:
    """Every final parameter within 1e-6 and moved, the key bias apart (see module)."""
    import torch

    for r, o in zip(ref, ours):
        for name, p in r["final"].items():
            q = o["final"][name].clone()
            key = _key_bias(name, p)
            if key is not None:  # rounding-noise gradient under Adam: checked apart
                for side in (r, o):
                    assert (
                        _key_bias(name, side["final"][name]) - _key_bias(name, side["init"][name])
                    ).abs().max() < 1e-5
                _key_bias(name, q).copy_(key)
            torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-6, msg=name)
            assert not torch.equal(o["final"][name], o["init"][name]), name


def test_unquantized_equals_zero1_sgd_every_parameter(runs):
    import torch

    ref_losses, ref = runs("zero1-sgd", "zero1", *SGD)
    losses, ours = runs("unquantized-sgd", "unquantized", *SGD)
    assert losses == pytest.approx(ref_losses, rel=1e-6, abs=0)
    _same_start(ref, ours)
    for r, o in zip(ref, ours):
        for name, p in r["final"].items():
            torch.testing.assert_close(o["final"][name], p, rtol=1e-6, atol=1e-6, msg=name)
            assert not torch.equal(o["final"][name], o["init"][name]), name
        _check_ledger(o, floor=True)


def test_quantized_default_trains_within_the_seed_spread(runs):
    import torch

    a, _ = runs("zero1", "zero1")
    b, _ = runs("zero1-seed", "zero1", "--seed", "1235")
    losses, ours = runs("quantized", "quantized")
    spread = max(abs(x - y) for x, y in zip(a, b))
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    assert max(abs(x - y) for x, y in zip(losses, a)) <= spread
    for o in ours:
        assert [n for n, p in o["final"].items() if torch.equal(p, o["init"][n])] == []
        _check_ledger(o, floor=True)  # its step crosses the node in fp32: the floor of its padded shards


# ---- the client's default path (GPTModelPipe on DeepSpeed's PipelineEngine) ------------
@pytest.mark.parametrize("pp,data", [(1, 4), (2, 2)])
def test_pipeline_engine_pipeline_form_equals_zero1_sgd_every_parameter(runs, pp, data):
    """Without ``--no-pipeline-parallel`` (``PP=1``: TP 2 x PP 1 x DP 4; ``PP=2``: TP 2 x PP 2 x DP 2,
    two micro-batches per iteration): ZeRO-topo's pipeline form, unquantized, equals DeepSpeed ZeRO-1
    on the same PipelineEngine within 1e-6 (losses, every parameter, all of which moved); its ledger
    equals its analytic model and, over the whole run, an independent count of torch.distributed's
    bytes; with PP 1 the inter-node bytes are the data group's floor plus the norm all-reduce."""
    import torch

    ref_losses, ref = runs(f"pp{pp}-zero1-sgd", "zero1", *SGD, pp=pp)
    losses, ours = runs(f"pp{pp}-unquantized-sgd", "unquantized", *SGD, pp=pp)
    assert losses == pytest.approx(ref_losses, rel=1e-6, abs=0) and len(losses) == 10
    _same_start(ref, ours)
    for r, o in zip(ref, ours):
        for name, p in r["final"].items():
            torch.testing.assert_close(o["final"][name], p, rtol=1e-6, atol=1e-6, msg=name)
            assert not torch.equal(o["final"][name], o["init"][name]), name
        _check_pipeline_ledger(o, pp, data)


@pytest.mark.parametrize("pp,data", [(1, 4), (2, 2)])
def test_pipeline_engine_quantized_default_trains_within_the_seed_spread(runs, pp, data):
    import torch

    a, _ = runs(f"pp{pp}-zero1", "zero1", pp=pp)
    b, _ = runs(f"pp{pp}-zero1-seed", "zero1", "--seed", "1235", pp=pp)
    losses, ours = runs(f"pp{pp}-quantized", "quantized", pp=pp)
    spread = max(abs(x - y) for x, y in zip(a, b))
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    assert max(abs(x - y) for x, y in zip(losses, a)) <= spread
    for o in ours:
        assert [n for n, p in o["final"].items() if torch.equal(p, o["init"][n])] == []
        _check_pipeline_ledger(o, pp, data)


def _check_pipeline_ledger(dump: dict, pp: int, data: int) -> None:
    measured, analytic = dump["measured"], dump["analytic"]
    assert dump["ledger_total"] == dump["torch_total"]
    assert set(analytic) == {"step"}  # the pipeline form gathers nothing in forward or backward
    assert {lv: measured["step"].get(lv) for lv in analytic["step"]} == analytic["step"]
    assert f"pipeline {pp}" in dump["banner"] and f"data {data}" in dump["banner"]
    assert "pipeline form" in dump["banner"]
    if pp == 1:  # data 4 crosses the node: 2 (M_stage / P)(N - 1)/N with P = 2, N = 2, plus the norm's all-reduce
        node = measured["step"]["node"]
        assert node == 2 * (dump["padded_bytes"] / 2) * (2 - 1) / 2 + 2 * 8 * (4 - 1) / 4


# ---- the tiled optimizer and PCCL on the client's pipeline path ----------------------
TILED = '"tiled_optimizer": {"enabled": true, "tile_size": 4096}'
PCCL = '"pccl": {"enabled": true}'


@pytest.mark.parametrize("pp", [1, 2])
@pytest.mark.parametrize("mode", ["zero1", "unquantized"], ids=["beside-zero1", "beside-pipeline-form"])
def test_pipeline_engine_tiled_optimizer_is_bit_identical(runs, pp, mode):
    """(a) TP 2 x PP 1 x DP 4 and (b) TP 2 x PP 2 x DP 2 on the PipelineEngine, the client's Adam:
    the tiled optimizer (4096-element tiles, so every large parameter spans several) prints the
    losses of the untiled run and ends with every parameter bit-identical, beside DeepSpeed's
    ZeRO-1 and beside ZeRO-topo's pipeline form."""
    import torch

    ref_losses, ref = runs(f"pp{pp}-{mode}", mode, pp=pp)
    losses, ours = runs(f"pp{pp}-{mode}-tiled", mode, pp=pp, plugins=TILED)
    assert losses == ref_losses and len(losses) == 10
    _same_start(ref, ours)
    for r, o in zip(ref, ours):
        for name, p in r["final"].items():
            assert torch.equal(o["final"][name], p), name


@pytest.mark.parametrize("mode", ["zero1", "unquantized"], ids=["beside-zero1", "beside-pipeline-form"])
def test_pipeline_engine_pccl_equals_native_collectives(runs, mode):
    """(b) TP 2 x PP 2 x DP 2, SGD: PCCL's all-gathers / reduce-scatters (001 §6.2) in place of the
    native ones give the losses and every parameter of the native run within float reordering
    (1e-6); exact on integer data is tests/test_pccl.py's."""
    import torch

    ref_losses, ref = runs(f"pp2-{mode}-sgd", mode, *SGD, pp=2)
    losses, ours = runs(f"pp2-{mode}-sgd-pccl", mode, *SGD, pp=2, plugins=PCCL)
    assert losses == pytest.approx(ref_losses, rel=1e-6, abs=0) and len(losses) == 10
    for r, o in zip(ref, ours):
        for name, p in r["final"].items():
            torch.testing.assert_close(o["final"][name], p, rtol=1e-6, atol=1e-6, msg=name)


# ---- fp16 in the pipeline form, forced overflows ----------------------------------------
# DeepSpeed's dynamic loss scaler from 2^22: the tiny GPT's gradients overflow fp16 until the scale is
# 2^18 (four skipped iterations), then after two good steps (window 2) it doubles and overflows again
FORCED_OVERFLOWS = '"initial_scale_power": 22, "loss_scale_window": 2, "hysteresis": 1, "min_loss_scale": 1'


@pytest.mark.parametrize("mode", ["unquantized", "quantized"])
def test_pipeline_engine_fp16_skips_as_zero1_fp16(runs, mode):
    """TP 2 x PP 2 x DP 2 on the PipelineEngine in fp16 (``--fp16``, the ds_config's fp16 section),
    overflows forced by the initial loss scale: ZeRO-topo's pipeline form skips the iterations DeepSpeed
    ZeRO-1 fp16 skips, with the same loss scale after each; unquantized, the printed losses of the
    applied iterations within 1e-3 of ZeRO-1's; both train every parameter, fp16 kept."""
    import torch

    ref_log, ref = runs("pp2-zero1-fp16", "zero1", pp=2, fp16=FORCED_OVERFLOWS)
    log, ours = runs(f"pp2-{mode}-fp16", mode, pp=2, fp16=FORCED_OVERFLOWS)
    skipped = [s for *_, s in ref_log]
    assert skipped[0] == 1 and 0 in skipped and (0, 1) in zip(skipped, skipped[1:])  # overflow, steps, overflow
    assert [(scale, s) for _, scale, s in log] == [(scale, s) for _, scale, s in ref_log]
    assert [loss is None for loss, *_ in log] == [bool(s) for s in skipped]
    if mode == "unquantized":
        for (loss, *_), (want, *_) in zip(log, ref_log):
            assert loss == pytest.approx(want, rel=1e-3, abs=0) if want is not None else loss is None
    _same_start(ref, ours)
    for o in ours:
        for name, p in o["final"].items():
            assert p.dtype == torch.float16 and torch.isfinite(p).all(), name
            assert not torch.equal(p, o["init"][name]), name
        _check_pipeline_ledger(o, 2, 2)


# ---- 004's Frontier recipes shrunk to 8 CPU ranks --------------------------------
RECIPES = sorted((REPO / "configs" / "frontier").glob("*.recipe"))


def _shrunk(recipe: Path, mode: str) -> str:
    """The ds_config (its content: the recipes' configs differ only in batch size and comment, which the
    shrink replaces) and the arguments ``mode`` of ``recipe`` runs with on 8 CPU ranks: runs of two
    recipes that shrink to the same job are one run."""
    import json

    proc = subprocess.run(
        ["bash", str(REPO / "examples" / "frontier_recipe_cpu.sh"), str(recipe), mode],
        env={**os.environ, "SHRINK_ONLY": "1"},
        capture_output=True,
        text=True,
        check=True,
    )
    config, args = proc.stdout.strip().split(" ", 1)
    cfg = json.loads((REPO / config).read_text())
    cfg.pop("_comment"), cfg.pop("train_batch_size")
    return f"{mode} {json.dumps(cfg, sort_keys=True)} {args}"


def _planned_step(dump: dict):
    """``ds-ext plan``'s ZeRO-topo pipeline-form step (``megatron_plans.zero_topo_step_traffic``) for
    the shrunk job of rank 0 (first stage, data rank 0): the tiny GPT with Megatron's padded
    vocabulary (its word embedding's rows over TP 2), fp16, on Frontier in miniature."""
    from ds_ext.planner import megatron_plans
    from ds_ext.planner.estimate import Job
    from ds_ext.planner.machine import lookup
    from ds_ext.planner.models import Arch
    from ds_ext.topology import Topology

    vocab = 2 * dump["final"]["tied_modules.embed.word_embeddings.weight"].shape[0]
    arch = Arch(name="shrunk", layers=4, hidden=64, heads=4, vocab=vocab, seq=64)
    topology = Topology.from_preset("frontier", RANKS, {"gpu": 2})
    job = Job(arch=arch, machine=lookup("frontier"), topology=topology, global_batch=8)
    return megatron_plans.zero_topo_step_traffic(job, 2, 2, 2, {"preset": "zero_topo", "form": "pipeline"})


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_frontier_recipe_shrunk_to_cpu(runs, recipe):
    """004's recipe, shrunk (examples/frontier_recipe_cpu.sh: TP 2 x PP 2 x DP 2, the recipe's fp16,
    micro-batch and activation checkpointing, tiny widths), on the real pretrain_gpt.py's
    PipelineEngine: with the recipe's ds_ext config (ZeRO-topo's pipeline form, the quantized default)
    the losses are finite, fall, and stay within the largest distance between the published ZeRO-1
    config's run and its run with ``--seed 1235``, every parameter moves and the ledger equals its
    model and ``ds-ext plan``'s prediction of the step; in fp32, unquantized, the printed losses equal ZeRO-1's within 1e-6 and every parameter
    too (the key bias under the client's Adam apart, see module)."""
    import torch

    shrunk = _shrunk(recipe, "ds_ext")
    assert "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2" in shrunk
    assert "--micro-batch-size 1" in shrunk and shrunk.endswith(
        "--fp16 --checkpoint-activations --deepspeed-activation-checkpointing"
    )
    named = {mode: _shrunk(recipe, mode) for mode in ("ds_ext", "plain", "plain-fp32", "unquantized-fp32")}
    assert "--fp16" not in named["plain-fp32"] and "--fp16" not in named["unquantized-fp32"]
    a, _ = runs(named["plain"], "plain", recipe=recipe)
    b, _ = runs(named["plain"] + " seed", "plain", "--seed", "1235", recipe=recipe)
    losses, ours = runs(named["ds_ext"], "ds_ext", recipe=recipe)
    spread = max(abs(x - y) for x, y in zip(a, b))
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    assert max(abs(x - y) for x, y in zip(losses, a)) <= spread
    for o in ours:
        assert [n for n, p in o["final"].items() if p.dtype != torch.float16 or torch.equal(p, o["init"][n])] == []
        _check_pipeline_ledger(o, 2, 2)
    assert dict(ours[0]["measured"]["step"]) == _planned_step(ours[0]).bytes  # ds-ext plan's model of the step
    ref_losses, ref = runs(named["plain-fp32"], "plain-fp32", recipe=recipe)
    fp32, ours = runs(named["unquantized-fp32"], "unquantized-fp32", recipe=recipe)
    assert fp32 == pytest.approx(ref_losses, rel=1e-6, abs=0)
    _same_start(ref, ours)
    _equal_under_adam(ref, ours)
    print(
        f"{recipe.stem}: fp16 ZeRO-1 {a}, --seed 1235 {b}, ds_ext {losses}; fp32 ZeRO-1 {ref_losses}, unquantized {fp32}"
    )
