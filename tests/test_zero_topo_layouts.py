"""ZeRO-topo inside real layouts: over the data-parallel group of Megatron tensor
parallelism, with the job's layout read once from the caller's mpu.

8 gloo ranks as Frontier in miniature (2 nodes x 2 MI250X x 2 GCDs). The model is the real
Megatron-DeepSpeed client's ``GPTModel`` (../shared/clients, unmodified) at tensor-parallel 2, built
and driven in-process the way its ``pretrain_gpt.py`` does with ``--no-pipeline-parallel``: its
``megatron.core.mpu`` passed as ``mpu=``, its vocab-parallel cross entropy as the loss. The
reference is DeepSpeed's own ZeRO-1 on the same model, mpu and batches (shares no code with
ZeRO-topo): the unquantized preset must equal it to fp32 rounding, gradient clipping active, so
the global norm over the tensor group (replicated norms and biases counted once) is checked too.
"""

import os
import sys
from pathlib import Path

import pytest
from ledger_support import assert_links_equal

WORLD_SIZE = 8
# never replaced: a fresh world's ranks re-import the client's Megatron (about 5 s a test, more
# than its groups cost)
WORLD_MAX_GROUPS = None
CLIENT = (
    Path(
        os.environ.get("DS_EXT_CLIENTS") or Path(__file__).resolve().parents[1].parent / "shared" / "clients",
    )
    / "megatron-deepspeed"
)
TOPOLOGY = {"preset": "frontier", "sizes": {"gpu": 2}, "emulate": True}
UNQUANTIZED = {"weights": {"gather_bits": 16}, "gradients": {"bits": 16, "hops": 1}, "secondary": {"bits": 16}}
SEQ, VOCAB, STEPS = 16, 128, 4
pytestmark = pytest.mark.skipif(not CLIENT.is_dir(), reason=f"Megatron-DeepSpeed client not found at {CLIENT}")


def _client_gpt(tensor: int):
    """The client's GPTModel at ``tensor``-parallel degree, its mpu initialized as
    ``initialize_megatron`` does (random init drawn whole on the CPU, then sliced)."""
    from unittest import mock

    import torch

    sys.path.insert(0, str(CLIENT))
    from megatron import global_vars
    from megatron.arguments import core_transformer_config_from_args, parse_args, validate_args
    from megatron.core import mpu, tensor_parallel
    from megatron.core.enums import ModelType
    from megatron.model import GPTModel

    argv = [
        "pretrain_gpt.py",
        "--num-layers",
        "2",
        "--hidden-size",
        "32",
        "--num-attention-heads",
        "4",
        "--seq-length",
        str(SEQ),
        "--max-position-embeddings",
        str(SEQ),
        "--micro-batch-size",
        "1",
        "--tensor-model-parallel-size",
        str(tensor),
        "--use-cpu-initialization",
        "--attention-dropout",
        "0",
        "--hidden-dropout",
        "0",
        "--no-masked-softmax-fusion",
        "--no-bias-gelu-fusion",
        "--no-bias-dropout-fusion",
        "--no-gradient-accumulation-fusion",
        "--seed",
        "1234",
        "--deepspeed",
        "--no-pipeline-parallel",
        "--distributed-backend",
        "gloo",
    ]
    with mock.patch.object(sys, "argv", argv):
        args = validate_args(parse_args())  # as initialize_megatron does
    args.padded_vocab_size = VOCAB
    args.model_type = ModelType.encoder_or_decoder  # what pretrain() sets for GPT
    global_vars.set_args(args)
    global_vars._GLOBAL_NUM_MICROBATCHES_CALCULATOR = None  # a world runs this more than once
    global_vars._build_num_microbatches_calculator(args)
    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(tensor)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    torch.manual_seed(1234)
    model = GPTModel(
        core_transformer_config_from_args(args),
        num_tokentypes=0,
        parallel_output=True,
        pre_process=True,
        post_process=True,
    )
    return model, mpu


def _batch(step: int, data_rank: int):
    import torch

    g = torch.Generator().manual_seed(1000 * step + data_rank)
    tokens = torch.randint(0, VOCAB, (1, SEQ + 1), generator=g)
    mask = torch.tril(torch.ones(1, 1, SEQ, SEQ)) < 0.5
    return tokens[:, :-1], torch.arange(SEQ).unsqueeze(0), mask, tokens[:, 1:]


class _Plain:
    """The client's GPT behind a plain ``nn.Module`` (for checkpoints: its own ``load_state_dict``
    reads Megatron's nested layout, not the flat ``state_dict()`` DeepSpeed saves, and DeepSpeed
    0.19.8 pickles its ``universal_checkpoint_info`` method, written for DeepSpeed <= 0.19.6)."""

    @staticmethod
    def wrap(model):
        import torch

        class Plain(torch.nn.Module):
            def __init__(self, gpt):
                super().__init__()
                self.gpt = gpt

            def forward(self, *args, **kwargs):
                return self.gpt(*args, **kwargs)

        return Plain(model)


def _engine(zero_topo, tensor=2, perturb=False, plain=False, adam=False, ds_ext_extra=None):
    """The client's GPT at ``tensor``-parallel degree in DeepSpeed ZeRO-1 (``zero_topo`` None) or
    ZeRO-topo with ``zero_topo``; ``perturb``: other initial weights (for loading into); ``plain``:
    behind :class:`_Plain`; ``adam``: AdamW instead of SGD; ``ds_ext_extra``: more of the
    ``"ds_ext"`` block (other plugins, ``comm``)."""
    import deepspeed
    import torch

    import ds_ext

    model, mpu = _client_gpt(tensor)
    if plain:
        model = _Plain.wrap(model)
    if perturb:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.5)
    cfg = {
        "train_batch_size": 8 // tensor,
        "train_micro_batch_size_per_gpu": 1,
        "gradient_clipping": 0.05,
        "zero_optimization": {"stage": 0 if zero_topo else 1},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**6,
    }
    # SGD moves each parameter in proportion to its gradient, so a wrong scale shows in every one
    # (Adam normalises it away, and turns the key bias's rounding-noise gradient into full steps)
    opt = (
        torch.optim.AdamW(model.parameters(), lr=1e-3)
        if adam
        else torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    )
    if zero_topo:
        cfg["ds_ext"] = {
            "topology": TOPOLOGY,
            "comm": {"count_torch_collectives": False},
            "zero_topo": {"enabled": True, **zero_topo},
        }
        for key, value in (ds_ext_extra or {}).items():
            cfg["ds_ext"][key] = {**cfg["ds_ext"].get(key, {}), **value}
        engine, *_ = ds_ext.initialize(model=model, optimizer=opt, config=cfg, mpu=mpu)
    else:
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg, mpu=mpu)
    return engine, mpu


def _steps(engine, mpu, steps, start=0, seed=0):
    """Losses and global norms of ``steps`` steps of the client's loss on this rank's data shard."""
    losses, norms = [], []
    for step in range(start, start + steps):
        tokens, position, mask, labels = _batch(step + 100 * seed, mpu.get_data_parallel_rank())
        loss = engine(tokens, position, mask, labels=labels)[0].float().mean()  # (losses, moe losses)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        norms.append(float(engine.get_global_grad_norm()))
    return losses, norms


def _params(engine):
    """This rank's full (tensor-parallel) parameters, gathered where ZeRO-topo shards them."""
    import torch

    with engine.ds_ext.gathered_parameters() if hasattr(engine, "ds_ext") else torch.no_grad():
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _train(zero_topo, seed=0):
    """Losses, global norms and this rank's (tensor-parallel) parameters after ``STEPS`` steps;
    with ZeRO-topo also its ledger and analytic model of the last step."""
    import torch
    import torch.distributed as dist

    engine, mpu = _engine(zero_topo)
    init = _params(engine)
    losses, norms = _steps(engine, mpu, STEPS, seed=seed)
    params = _params(engine)
    out = {
        "losses": losses,
        "norms": norms,
        "params": params,
        "rank": dist.get_rank(),
        "still": [n for n, p in params.items() if torch.equal(p, init[n])],
    }
    if zero_topo:
        plugin = engine.ds_ext.plugins[0]
        last = engine.ds_ext.ledger.steps[-1]
        out |= {
            "describe": plugin.describe(),
            "banner": engine.ds_ext.banner(),
            "measured": {ph: dict(v) for ph, v in last.by_phase().items() if ph != "other"},
            "analytic": plugin.analytic_traffic(1).bytes,
            "measured_links": last.link_bytes_by_phase(),
            "analytic_links": plugin.analytic_traffic(1).links,
            "padded_bytes": sum(u.U for u in plugin.sharded.all_units) * 4,
        }
    engine.destroy()
    mpu.destroy_model_parallel()
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def zero1(world):
    """DeepSpeed ZeRO-1's run under TP 2 (the reference of the tests below, run once)."""
    return world.run(_train, None)


def test_unquantized_zero_topo_equals_deepspeed_zero1_under_megatron_tp2(world, zero1):
    """Losses, global gradient norms (clipping active) and every parameter equal DeepSpeed ZeRO-1
    under the same tensor parallelism; the plan sits on the levels the data group crosses; the
    ledger equals the analytic model, and the inter-node bytes of the gradient synchronisation are
    the floor 2 (M_dp / P)(N - 1)/N of the data-parallel group (P = 2 of its ranks per node, N = 2)."""
    import torch

    ref = zero1
    ours = world.run(_train, {"preset": "zero_topo", **UNQUANTIZED})
    for r, o in zip(ref, ours):
        assert o["losses"] == pytest.approx(r["losses"], rel=1e-6, abs=0)
        assert o["norms"] == pytest.approx(r["norms"], rel=1e-6, abs=0)
        assert r["norms"][0] > 0.05  # the clip is active
        assert o["still"] == [] and r["still"] == []  # every parameter trained
        assert set(o["params"]) == set(r["params"])
        for name, p in r["params"].items():
            torch.testing.assert_close(o["params"][name], p, rtol=1e-6, atol=1e-6, msg=name)
        assert o["measured"] == o["analytic"]
        assert_links_equal(o["measured_links"], o["analytic_links"])
        # the data group never crosses the GCD pair; only the norm's sum over the tensor group does
        assert [(ph, lv) for ph, v in o["measured"].items() for lv in v if lv == "gcd"] == [("step", "gcd")]
        assert o["measured"]["step"]["gcd"] == 2 * 8 * (2 - 1) / 2
        node = sum(levels.get("node", 0) for levels in o["measured"].values())
        norm = 2 * 8 * (4 - 1) / 4  # the grad-norm all-reduce over the 4 ranks of the data group
        assert node == 2 * (o["padded_bytes"] / 2) * (2 - 1) / 2 + norm
    assert "weights gpu" in ours[0]["describe"] and "data-parallel group" in ours[0]["describe"]
    assert "tensor 2 (crosses gcd)" in ours[0]["banner"] and "data 4 (crosses node)" in ours[0]["banner"]


def test_quantized_default_trains_every_parameter_within_the_seed_spread(world, zero1):
    """The default (quantized) preset under TP 2: every parameter moves; each step's loss is within
    the spread between ZeRO-1 runs on two data orders."""
    a, b = zero1, world.run(_train, None, 1)
    ours = world.run(_train, {"preset": "zero_topo"})
    for r0, r1, o in zip(a, b, ours):
        spread = max(abs(x - y) for x, y in zip(r0["losses"], r1["losses"]))
        assert o["still"] == []
        assert max(abs(x - y) for x, y in zip(o["losses"], r0["losses"])) <= spread
        assert o["measured"] == o["analytic"]


def _refused(case):
    """The one-line refusal of ``case`` on this rank (before any ZeRO-topo collective); for
    'pmm3d_mpu' (3D-PMM beside the caller's TP 2 mpu, no ZeRO-topo) None unless no process group
    was created first."""
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from megatron.core import mpu

    import ds_ext
    from ds_ext.errors import DsExtError

    sys.path.insert(0, str(CLIENT))
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    zero_topo = {"enabled": True, "preset": "zero_topo"}
    if case == "gcd":
        zero_topo["weights"] = {"level": "gcd"}
    kwargs = {"mpu": mpu}
    pmm = {}
    if case in ("pmm3d", "pmm3d_mpu"):
        from ds_ext.models import GPT, GPTConfig

        model = GPT(GPTConfig(seq_len=16, d_model=64, n_layers=2, n_heads=8))
        pmm = {
            "pmm3d": {"enabled": True, "grid": {"x": 2, "y": 1, "z": 2, "data": 2}, "overlap": {"reduce_scatter": True}}
        }
        kwargs = kwargs if case == "pmm3d_mpu" else {}
    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(2, 2 if case == "pipeline" else 1)
    cfg = {
        "train_batch_size": 8 // mpu.get_tensor_model_parallel_world_size() // (2 if case == "pipeline" else 1),
        "ds_ext": {"topology": TOPOLOGY, **({} if case == "pmm3d_mpu" else {"zero_topo": zero_topo}), **pmm},
    }
    groups = c10d._world.group_count
    try:
        ds_ext.initialize(model=model, optimizer=lambda params: torch.optim.SGD(params, lr=0.1), config=cfg, **kwargs)
        msg = None
    except DsExtError as err:
        msg = None if case == "pmm3d_mpu" and c10d._world.group_count != groups else str(err)
    mpu.destroy_model_parallel()
    dist.barrier()
    return msg


@pytest.mark.parametrize(
    "case,expected",
    [
        (
            "gcd",
            "ds_ext.zero_topo.weights.level: topology 'frontier, data-parallel group of tensor 2 x pipeline 1 x "
            "data 4' has no level 'gcd'; allowed: gpu, node",
        ),
        (
            "pipeline",
            "ds_ext.zero_topo: pipeline parallel size 2 (from the caller's mpu= argument) with a model that is "
            "no deepspeed.pipe.PipelineModule; allowed: 1, or a PipelineModule (the pipeline form)",
        ),
        ("pmm3d", "ds_ext.pmm3d.overlap.reduce_scatter with ds_ext.zero_topo: not supported"),
        (
            "pmm3d_mpu",
            "ds_ext.pmm3d with the caller's mpu= argument (tensor parallel 2, pipeline parallel 1): 3D-PMM "
            "builds its own tensor grid and hands DeepSpeed its mpu; allowed: no mpu, or one of tensor and "
            "pipeline parallel 1",
        ),
    ],
)
def test_layouts_zero_topo_cannot_serve_are_refused_in_one_line(world, case, expected):
    """A level the data-parallel group does not cross (TP 2 fills the GCD pair), named explicitly,
    a pipeline degree without a PipelineModule and 3D-PMM's ORS beside ZeRO-topo: one line on every
    rank. 3D-PMM beside the caller's TP 2 mpu: one line before any collective."""
    for msg in world.run(_refused, case):
        assert msg is not None and msg.startswith(expected) and "\n" not in msg, msg


def _beside(extra):
    """Losses and this rank's parameters after ``STEPS`` AdamW steps of unquantized ZeRO-topo under
    TP 2 with ``extra`` in the ``"ds_ext"`` block."""
    import torch.distributed as dist

    engine, mpu = _engine({"preset": "zero_topo", **UNQUANTIZED}, adam=True, ds_ext_extra=extra)
    losses, _ = _steps(engine, mpu, STEPS)
    params = _params(engine)
    engine.destroy()
    mpu.destroy_model_parallel()
    dist.barrier()
    return losses, params


def test_tiled_optimizer_and_pccl_under_tensor_parallelism(world):
    """Under TP 2: the tiled optimizer (001 §7.2) is bit-identical to the untiled step, and ZeRO-topo's
    collectives through PCCL (001 ch. 6) equal the native ones within float reordering."""
    import torch

    base = world.run(_beside, {})
    tiled = world.run(_beside, {"tiled_optimizer": {"enabled": True, "tile_size": 4096}})
    pccl = world.run(_beside, {"comm": {"algorithm": "pccl"}})
    for (losses, params), (t_losses, t_params), (p_losses, p_params) in zip(base, tiled, pccl):
        assert t_losses == losses and p_losses == pytest.approx(losses, rel=1e-6, abs=0)
        for name, p in params.items():
            assert torch.equal(t_params[name], p), name
            torch.testing.assert_close(p_params[name], p, rtol=1e-5, atol=1e-6, msg=name)


def _checkpoint(tmp):
    """Save at step 2 under TP 2, train 2 more; a fresh engine from other weights loads the save
    and trains the same 2 steps; a TP 1 run refuses the save in one line."""
    import torch.distributed as dist

    from ds_ext.errors import DsExtError

    zero_topo = {"preset": "zero_topo"}
    engine, mpu = _engine(zero_topo, plain=True)
    _steps(engine, mpu, 2)
    engine.save_checkpoint(tmp, tag="t2")
    after, _ = _steps(engine, mpu, 2, start=2)
    engine.destroy()
    mpu.destroy_model_parallel()
    fresh, mpu = _engine(zero_topo, perturb=True, plain=True)
    fresh.load_checkpoint(tmp, tag="t2")
    resumed, _ = _steps(fresh, mpu, 2, start=2)
    fresh.destroy()
    mpu.destroy_model_parallel()
    other, mpu = _engine(zero_topo, tensor=1, plain=True)
    try:
        other.load_checkpoint(tmp, tag="t2")
        refused = None
    except DsExtError as err:
        refused = str(err)
    other.destroy()
    mpu.destroy_model_parallel()
    dist.barrier()
    return after, resumed, refused


def test_checkpoint_round_trip_under_tensor_parallelism(world, tmp_path):
    """Each model-parallel rank's shards in a folder of their own: resuming from them repeats the
    losses bit for bit; another model-parallel size is refused in one line on every rank;
    ``consolidate`` refuses tensor-parallel slices in one line (it joins pipeline stages only)."""
    from ds_ext.zero_topo.checkpoint import CheckpointError, consolidate

    for after, resumed, refused in world.run(_checkpoint, str(tmp_path)):
        assert resumed == after
        assert refused is not None and "was saved with model-parallel size 2, this run has 1" in refused, refused
    parts = sorted(p.name for p in (tmp_path / "t2").iterdir() if p.is_dir())
    assert parts == ["ds_ext_zero_topo_mp00", "ds_ext_zero_topo_mp01"]
    assert sorted(p.name for p in (tmp_path / "t2" / parts[1]).iterdir()) == [
        f"ds_ext_zero_topo_rank{r:05d}.pt" for r in range(4)
    ]
    with pytest.raises(CheckpointError, match=r"tensor parallel 2\), which ds_ext cannot join"):
        consolidate(tmp_path / "t2")
