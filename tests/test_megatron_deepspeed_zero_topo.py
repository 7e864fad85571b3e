"""Issue 36's end-to-end acceptance: the real Megatron-DeepSpeed ``pretrain_gpt.py`` (unmodified,
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
"""

import math
import os
import subprocess
from pathlib import Path

import pytest

from clients import MDS_ENV, MDS_READY, MDS_SKIP, lm_losses

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not MDS_READY, reason=MDS_SKIP)
SGD = ("--optimizer", "sgd", "--sgd-momentum", "0.9", "--lr", "0.1", "--min-lr", "0.01")
RANKS = 8


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``runs(name, mode, *args)``: (printed losses, each rank's dump), each run once per module."""
    import torch

    done = {}

    def run(name: str, mode: str, *args: str, pp: int | None = None, plugins: str | None = None):
        if name not in done:
            dump = tmp_path_factory.mktemp(name)
            env = {**os.environ, **MDS_ENV, "FINAL_DUMP": str(dump), **({"PP": str(pp)} if pp else {})}
            env |= {"PLUGINS": plugins} if plugins else {}
            proc = subprocess.run(
                ["bash", str(REPO / "examples" / "megatron_deepspeed_zero_topo.sh"), mode, *args],
                env=env,
                capture_output=True,
                text=True,
                timeout=900,
            )
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
            done[name] = (lm_losses(proc.stdout), [torch.load(dump / f"rank{r}.pt") for r in range(RANKS)])
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
    import torch

    ref_losses, ref = runs("zero1", "zero1")
    losses, ours = runs("unquantized", "unquantized")
    assert losses == pytest.approx(ref_losses, rel=1e-6, abs=0)
    _same_start(ref, ours)
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
        _check_ledger(o, floor=True)


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


# ---- issue 37: the client's default path (GPTModelPipe on DeepSpeed's PipelineEngine) ------------
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


# ---- issue 37: the tiled optimizer and PCCL on the client's pipeline path ----------------------
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
