"""The GPU path (NCCL / CUDA), run with ``pytest -m gpu`` on a machine with a CUDA device and
skipped elsewhere (conftest). Results of the last run: examples/results/gpu/.

References: the CPU path of the same quantizer (bits); DeepSpeed's FusedAdam CUDA kernel
untiled (bits); a matmul's FLOP count against a peak above any GPU's (event timing, not
launch timing); plain DeepSpeed (``deepspeed.initialize``, no ds_ext) on the same model,
data and seed for each plugin at world size 1 on NCCL (degenerate groups); ZeRO-topo's step on the
device for its optimizer offload (device peak memory, placement of every state tensor).
"""

import pytest
import torch

pytestmark = pytest.mark.gpu

WORLD_SIZE = 1
WORLD_BACKEND = ("nccl", "cuda")
SEQ, MICRO, STEPS = 32, 4, 6
TOPOLOGY = {"preset": "frontier", "sizes": {"gpu": 1, "gcd": 1}}  # world 1: every level of size one


# ---- block quantizer: CUDA (eager and compiled) == CPU, bit for bit ------------------------------
def _quant_input(n, dtype):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g) * torch.logspace(-6, 4, n)  # ten decades of magnitude
    x[512 * 3 : 512 * 4] = 0.0  # an all-zero block
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("compile", [False, True])
def test_block_quantizer_on_cuda_is_bit_identical_to_cpu(bits, compile, dtype):
    from ds_ext.comm.quant import COMPILE_MIN_NUMEL, BlockQuantizer

    cpu, gpu = BlockQuantizer(bits, 512), BlockQuantizer(bits, 512, compile=compile)
    for n in (5000, COMPILE_MIN_NUMEL * 16 + 300):  # eager below the compile threshold; a partial last block
        x = _quant_input(n, dtype)
        ref, got = cpu.quantize(x), gpu.quantize(x.cuda())
        assert got.payload.is_cuda and torch.equal(got.payload.cpu(), ref.payload), (n, "payload")
        assert torch.equal(got.scales.cpu().view(torch.int32), ref.scales.view(torch.int32)), (n, "scales")
        for out in (torch.float32, torch.bfloat16):
            assert torch.equal(gpu.dequantize(got, out).cpu(), cpu.dequantize(ref, out)), (n, out)


@pytest.mark.parametrize("compile", [False, True])
def test_block_quantizer_flags_non_finite_blocks_on_cuda_as_on_cpu(compile):
    from ds_ext.comm.quant import NONFINITE, BlockQuantizer

    x = _quant_input(1 << 20, torch.float16)
    x[7], x[600_001] = float("inf"), float("nan")
    ref = BlockQuantizer(4, 512).quantize(x, nonfinite="flag")
    got = BlockQuantizer(4, 512, compile=compile).quantize(x.cuda(), nonfinite="flag")
    assert torch.equal(got.payload.cpu(), ref.payload)
    assert torch.equal(got.scales.cpu().view(torch.int32), ref.scales.view(torch.int32))
    assert (ref.scales == NONFINITE).sum() == 2


@pytest.mark.parametrize("bits", [8, 4])
def test_fused_quantizer_is_one_launch_each_way_without_a_host_wait(bits):
    """compile=True on the GPU: encode (gradient path) and decode are one kernel each, and
    neither waits for the device (sync debug mode "error" raises on any synchronising call);
    the weight path's non-finite check is the same one kernel plus one read of its flag."""
    from torch.profiler import ProfilerActivity, profile

    from ds_ext.comm.quant import BlockQuantizer, QuantizationError

    qz = BlockQuantizer(bits, 512, compile=True)
    x = _quant_input((1 << 20) + 300, torch.bfloat16).cuda()
    q = qz.quantize(x, nonfinite="flag")  # compile outside the counted calls
    qz.dequantize(q, torch.bfloat16)
    qz.quantize(x)
    torch.cuda.synchronize()
    for call in (
        lambda: qz.quantize(x, nonfinite="flag"),
        lambda: qz.dequantize(q, torch.bfloat16),
        lambda: qz.quantize(x),
    ):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize()
        on_device = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
        kernels = [n for n in on_device if not n.startswith(("Memcpy", "Memset"))]
        assert len(kernels) == 1, on_device
    torch.cuda.set_sync_debug_mode("error")
    try:
        qz.dequantize(qz.quantize(x, nonfinite="flag"), torch.bfloat16)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    x[5] = float("nan")
    with pytest.raises(QuantizationError, match="1 non-finite elements"):
        qz.quantize(x)
    x[5] = 0.0
    qz.quantize(x)  # the next call is clean again


# ---- tiled FusedAdam on DeepSpeed's CUDA kernel == its untiled step ------------------------------
@pytest.mark.parametrize("adam_w_mode,bias_correction", [(True, True), (False, False)])
@pytest.mark.parametrize("tile", [16, 4096, 10**6])
def test_tiled_deepspeed_fused_adam_cuda_kernel_is_bit_identical(adam_w_mode, bias_correction, tile):
    from test_tiled_optimizer import fused_adam_tiles_match

    fused_adam_tiles_match(adam_w_mode, bias_correction, tile, device="cuda")


# ---- matmul tuning times kernels between CUDA events ---------------------------------------------
def test_matmul_tuning_times_kernels_not_launches():
    """A 8192^3 bf16 product is 1.1 TFLOP: at a peak above any GPU's (2 PFLOP/s) it takes at least
    0.55 ms. Host-clock timing of the asynchronous launch reports tens of microseconds."""
    from ds_ext.pmm.tuning import MODES, time_mode

    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    floor = 2 * n**3 / 2e15
    times = {mode: time_mode(mode, a, b) for mode in MODES}
    assert all(t >= floor for t in times.values()), (floor, times)
    # layout conversions cost a copy each: NN of row-major operands is never slower than TT
    assert min(times.values()) < 10 * floor, times


# ---- each plugin at world size 1 on NCCL vs plain DeepSpeed --------------------------------------
def _corpus():
    from ds_ext.data import ByteCorpus

    return ByteCorpus(max_bytes=200_000)


def _gpt(seed=1234):
    from ds_ext.models import GPT, GPTConfig

    torch.manual_seed(seed)
    return GPT(GPTConfig(seq_len=SEQ, d_model=64, n_layers=2, n_heads=4))


def _base(precision="fp32", stage=0, **extra):
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**6,
        **extra,
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def _train(engine, steps=STEPS, start=0):
    import torch.distributed as dist

    corpus, losses = _corpus(), []
    for step in range(start, start + steps):
        tokens = corpus.micro_batch(step, 0, dist.get_rank(), dist.get_world_size(), MICRO, 1, SEQ).to(engine.device)
        loss = engine(tokens)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _args():
    """DeepSpeed's ``device_rank``: the device the World chose for this rank (DeepSpeed would take
    LOCAL_RANK, which names no device where ranks share one)."""
    import argparse

    return argparse.Namespace(device_rank=torch.cuda.current_device()) if torch.cuda.is_available() else None


def _deepspeed(model, cfg, optimizer=None):
    import deepspeed

    opt = optimizer or torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    engine, *_ = deepspeed.initialize(args=_args(), model=model, optimizer=opt, config=cfg)
    return engine


def _ds_ext(model, cfg, optimizer="adamw"):
    import ds_ext

    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01) if optimizer == "adamw" else optimizer
    engine, *_ = ds_ext.initialize(args=_args(), model=model, optimizer=opt, config=cfg)
    return engine


def _params(engine):
    return {n: p.detach().float().cpu().clone() for n, p in engine.module.named_parameters()}


def zero_topo_run(tmp, topology=TOPOLOGY):
    """Unquantized ZeRO-topo (fp32) equals plain DeepSpeed; a checkpoint round trip continues
    the same run; the default preset (bf16, int4 gradients) with per-parameter quantization
    groups moves every parameter (packed int4 blocks leave a LayerNorm
    unmoved, even at world size one)."""
    unquantized = {"weights": {"gather_bits": 16}, "gradients": {"bits": 16, "hops": 1}, "secondary": {"bits": 16}}
    ref = _train(_deepspeed(_gpt(), _base()), STEPS + 2)
    block = {"topology": topology, "zero_topo": {"enabled": True, **unquantized}}
    engine = _ds_ext(_gpt(), _base(ds_ext=block))
    ours = _train(engine)
    engine.save_checkpoint(tmp, tag="gpu")
    resumed = _ds_ext(_gpt(seed=99), _base(ds_ext=block))
    resumed.load_checkpoint(tmp, tag="gpu")
    ours += _train(resumed, 2, start=STEPS)
    initial = {n: p.detach().float().cpu() for n, p in _gpt().named_parameters()}
    default = _ds_ext(_gpt(), _base("bf16", ds_ext={"topology": topology, "zero_topo": {"enabled": True}}))
    trained = _train(default, 10)
    after = {n: p.detach().float().cpu() for n, p in default.module.state_dict().items() if n in initial}
    unmoved = sorted(n for n in initial if n not in after or torch.equal(after[n], initial[n]))
    return {"ref": ref, "ours": ours, "default": trained, "unmoved": unmoved, "device": str(default.device)}


def _ted_world1():
    """TEDMoE (TP 1, EP 1, DTD and CAC on, blocks recomputed) equals DeepSpeed's MoE layer on
    the same GPT-MoE, initialization and data (top-1 dropless: DeepSpeed's capacity drop keeps
    tokens by ``topk`` over equal mask values, whose tie order is the kernel's own)."""
    import dataclasses

    import deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    from ds_ext.models.gpt_moe import GPTMoE, GPTMoEConfig

    cfg = GPTMoEConfig(
        seq_len=SEQ,
        d_model=32,
        n_layers=2,
        n_heads=4,
        num_experts=4,
        min_capacity=0,
        use_rts=False,
        top2_2nd_expert_sampling=False,
        drop_tokens=False,
        checkpoint="torch",
    )
    torch.manual_seed(0)
    state = GPTMoE(cfg).state_dict()

    def model(impl):
        m = GPTMoE(dataclasses.replace(cfg, moe_impl=impl))
        m.load_state_dict(state)
        return m

    def opt(m):
        groups = split_params_into_different_moe_groups_for_optimizer(
            {"params": list(m.parameters()), "name": "dense", "lr": 3e-3, "weight_decay": 0.01}
        )
        return torch.optim.AdamW(groups, lr=3e-3, weight_decay=0.01)

    ds_model = model("deepspeed")
    engine, *_ = deepspeed.initialize(args=_args(), model=ds_model, optimizer=opt(ds_model), config=_base(stage=1))
    ref = _train(engine)
    ted = {
        "enabled": True,
        "tensor_parallel": 1,
        "expert_parallel": 1,
        "duplicate_token_dropping": True,
        "comm_aware_checkpointing": True,
    }
    ted_model = model("ted")
    ours = _train(_ds_ext(ted_model, _base(stage=1, ds_ext={"topology": TOPOLOGY, "ted": ted}), opt(ted_model)))
    return {"ref": ref, "ours": ours}


def _tiled_world1():
    """The tiled optimizer on DeepSpeed's FusedAdam (CUDA kernel, ds_config ``optimizer``
    section), bf16 ZeRO-1: the same bits as the untiled step (losses, weights)."""
    section = {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}}
    runs = {}
    for tile in (None, 1024):
        block = {"tiled_optimizer": {"enabled": True, "tile_size": tile}} if tile else {}
        engine = _ds_ext(_gpt(), _base("bf16", stage=1, optimizer=section, ds_ext=block), optimizer=None)
        runs[tile] = {
            "losses": _train(engine),
            "params": _params(engine),
            "optimizer": type(engine.optimizer.optimizer).__name__,
        }
    return {"ref": runs[None], "ours": runs[1024]}


def _offload_world1():
    """ZeRO-topo in bf16 with the tiled optimizer (tiles of 2^20), its step on the device against
    optimizer offload (``pin_memory`` true: page-locked staging tiles, copies on a side stream):
    device peak memory over the training steps above what was allocated before
    ``ds_ext.initialize`` (``torch.cuda.max_memory_allocated``), the placement of every master and
    Adam state tensor (on the host, held by the offload store, staging tiles page-locked:
    ``offload_placement``), and the losses."""
    import gc

    from ds_ext.models import GPT, GPTConfig

    unquantized = {"weights": {"gather_bits": 16}, "gradients": {"bits": 16, "hops": 1}, "secondary": {"bits": 16}}
    block = {
        "topology": TOPOLOGY,
        "zero_topo": {"enabled": True, **unquantized},
        "tiled_optimizer": {"enabled": True, "tile_size": 1 << 20},
    }
    runs = {}
    for offload in (False, True):
        zero = {"stage": 0, **({"offload_optimizer": {"device": "cpu", "pin_memory": True}} if offload else {})}
        torch.manual_seed(1234)
        model = GPT(GPTConfig(seq_len=SEQ, d_model=256, n_layers=4, n_heads=4))
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        engine = _ds_ext(model, _base("bf16", zero_optimization=zero, ds_ext=block))
        losses = _train(engine)
        torch.cuda.synchronize()
        opt = engine.ds_ext.plugin("zero_topo").optimizer
        runs[offload] = {
            "losses": losses,
            "peak": torch.cuda.max_memory_allocated() - base,
            "trainable": sum(m.numel() for *_, m in opt.segments),
            "masters_on": sorted({str(m.device) for *_, m in opt.segments}),
            "placed": opt.offload_placement() if offload else 0,
        }
        engine.destroy()
        del engine, opt, model
    return {"device": runs[False], "offload": runs[True]}


def _pmm3d_world1():
    """3D-PMM on grid (1, 1, 1, 1) with every overlap and matmul tuning on (fp32) equals plain
    DeepSpeed on the serial model."""
    ref = _train(_deepspeed(_gpt(), _base()))
    pmm = {
        "enabled": True,
        "grid": {"x": 1, "y": 1, "z": 1, "data": 1},
        "tune_matmul": True,
        "overlap": {"all_reduce": True, "reduce_scatter": True, "all_gather": True},
    }
    engine = _ds_ext(
        _gpt(),
        _base(ds_ext={"topology": TOPOLOGY, "pmm3d": pmm}),
        optimizer=lambda p: torch.optim.AdamW(p, lr=3e-3, weight_decay=0.01),
    )
    ours = _train(engine)
    return {"ref": ref, "ours": ours, "tuned": len(engine.ds_ext.plugin("pmm3d").engine.tuner.choice)}


def _close(ref, ours, rtol):
    assert len(ref) == len(ours)
    for a, b in zip(ref, ours):
        assert abs(a - b) <= rtol * abs(a), (ref, ours)


def test_zero_topo_at_world_size_one_on_nccl(world, tmp_path):
    (r,) = world.run(zero_topo_run, str(tmp_path))
    assert r["device"].startswith("cuda"), r["device"]
    _close(r["ref"], r["ours"], 1e-5)
    assert r["unmoved"] == [] and r["default"][-1] < r["default"][0], r


def test_ted_at_world_size_one_on_nccl(world):
    (r,) = world.run(_ted_world1)
    _close(r["ref"], r["ours"], 1e-5)
    assert r["ref"][-1] < r["ref"][0]


def test_tiled_optimizer_at_world_size_one_on_nccl(world):
    (r,) = world.run(_tiled_world1)
    assert r["ref"]["optimizer"] == r["ours"]["optimizer"] == "FusedAdam"
    assert r["ref"]["losses"] == r["ours"]["losses"]
    for name, p in r["ref"]["params"].items():
        assert torch.equal(p, r["ours"]["params"][name]), name


def test_optimizer_offload_lowers_device_peak_memory_at_world_size_one_on_nccl(world):
    """Offload moves the fp32 masters and both Adam moments (12 bytes per trainable parameter) off the
    device: the device peak drops by at least 8 bytes per parameter (the on-device step also holds the
    tile buffer; offload holds every unit's 16-bit updated slice at once). The host step runs torch's
    CPU Adam arithmetic, which may round differently from its CUDA kernels (FMA contraction), so the
    losses agree within 1e-3 here; bit identity to the on-device step is tested where both run the
    same arithmetic (tests/test_zero_topo_offload.py, on the CPU)."""
    (r,) = world.run(_offload_world1)
    device, offload = r["device"], r["offload"]
    assert len(device["masters_on"]) == 1 and device["masters_on"][0].startswith("cuda"), r
    assert offload["masters_on"] == ["cpu"] and offload["placed"] > 0, r
    assert device["peak"] - offload["peak"] >= 8 * device["trainable"], r
    _close(device["losses"], offload["losses"], 1e-3)
    assert device["losses"][-1] < device["losses"][0]


def test_pmm3d_at_world_size_one_on_nccl(world):
    (r,) = world.run(_pmm3d_world1)
    _close(r["ref"], r["ours"], 1e-5)
    assert r["tuned"] > 0
