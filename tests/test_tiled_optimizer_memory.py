"""Step memory of the tiled optimizer (001 §7.2) on 4 gloo ranks.

Its own module, so its world is in memory mode (``mallopt``: allocations above 64 KiB
are mmapped and leave the resident set when freed) from the first large allocation on:
a heap that already holds large freed chunks would hide or double-count temporaries.
"""

import torch

WORLD_SIZE = 4


MEM_TILE = 65_536
SLACK = 1 << 20  # allocator, gloo and Python bookkeeping during a step


def _step_peak(experts, tile):
    """Median extra resident bytes of engine.step() (steps 2-4) on this rank."""
    from ds_ext.bench import median
    from ds_ext.bench.tiled import batch, measure_peak, moe_engine, use_mmap_for_large_allocations

    use_mmap_for_large_allocations()
    engine = moe_engine(experts, "tiled" if tile else "untiled", tile, 128, 512)
    peaks = []
    for step in range(4):
        x, y = batch(step, 128, 16, torch.bfloat16)
        engine.backward(engine(x, y))
        peak, _, _ = measure_peak(engine.step)
        if step >= 1:
            peaks.append(peak)
    out = {
        "peak": median(peaks),
        "max_param": max(p.numel() for p in engine.module.parameters()),
        "buffers": engine.ds_ext.plugins[-1].tiled.buffer.allocations if tile else 0,
    }
    engine.destroy()
    return out


def test_step_peak_is_bounded_by_the_tile_and_flat_in_experts(world):
    """ZeRO-1 bf16, ep 4: with E=16 each rank holds 4x the expert parameters of E=4.

    Peak = extra resident bytes during engine.step() (mmap for allocations > 64 KiB,
    VmHWM reset right before the step). Bound: 4 x tile_size (the tile buffer) + 8 x the
    largest parameter (DeepSpeed's norm up-casts one gradient at a time to fp64) + 1 MiB.
    """
    runs = {(e, t): world.run(_step_peak, e, t) for e in (4, 16) for t in (None, MEM_TILE)}
    res = {key: max(r["peak"] for r in per_rank) for key, per_rank in runs.items()}
    max_param = runs[(4, MEM_TILE)][0]["max_param"]
    bound = 4 * MEM_TILE + 8 * max_param + SLACK
    for e in (4, 16):
        assert res[(e, MEM_TILE)] <= bound, (e, res, bound)
    # untiled grows with the local expert parameters and breaks the tiled bound; tiled
    # stays flat: its growth is under a tenth of untiled's (a few hundred KiB of allocator
    # noise between ranks and runs, so a growth, not a ratio of two small peaks)
    assert res[(16, None)] >= 2.5 * res[(4, None)], res
    growth = {t: res[(16, t)] - res[(4, t)] for t in (None, MEM_TILE)}
    assert growth[MEM_TILE] <= 0.1 * growth[None], (growth, res)
    assert res[(16, None)] > bound, (res, bound)


PIPE_HIDDEN, PIPE_LAYERS = 1024, 4  # 4.2M parameters, 1.05M optimizer elements per rank over 4 ranks


def _pipeline_engine(tile, gradients=None, bucket=None, bias=False, compiled=True):
    """ZeRO-topo's pipeline form, fp16 with its loss scale, 1 stage of ``PIPE_LAYERS`` linears x 4
    data-parallel ranks (Frontier in miniature: 2 GCDs x 2 GPUs), in memory mode; ``compiled``:
    ``zero_topo.compile_quantizer`` (its default, on)."""
    import torch
    from deepspeed.accelerator import get_accelerator
    from deepspeed.pipe import LayerSpec, PipelineModule
    from torch import nn

    import ds_ext
    from ds_ext.bench.tiled import use_mmap_for_large_allocations
    from ds_ext.integration import ds_engine

    use_mmap_for_large_allocations()
    ds_engine.init_distributed()
    get_accelerator().is_fp16_supported = lambda: True  # torch's fp16 CPU kernels suffice here
    torch.manual_seed(0)
    layers = [LayerSpec(nn.Linear, PIPE_HIDDEN, PIPE_HIDDEN, bias=bias) for _ in range(PIPE_LAYERS)]
    model = PipelineModule(layers, num_stages=1, loss_fn=lambda y, t: (y.float() - t.float()).pow(2).mean())
    block = {"topology": {"preset": "frontier", "sizes": {"gcd": 2, "gpu": 2}, "emulate": True}}
    block["zero_topo"] = {"enabled": True, "preset": "zero_topo", "form": "pipeline", "compile_quantizer": compiled}
    if gradients:
        block["zero_topo"]["gradients"] = gradients
    if tile:
        block["tiled_optimizer"] = {"enabled": True, "tile_size": tile}
    cfg = {
        "train_batch_size": 8,
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 0, **({"reduce_bucket_size": bucket} if bucket else {})},
        "fp16": {"enabled": True, "initial_scale_power": 8},
        "steps_per_print": 10**6,
        "ds_ext": block,
    }
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, *_ = ds_ext.initialize(model=model, optimizer=opt, config=cfg)
    return engine


def _train_batch(engine, i):
    import torch

    x = torch.randn(2, PIPE_HIDDEN, generator=torch.Generator().manual_seed(i)).half()
    engine.train_batch(iter([(x, x)]))


def _pipeline_step_peak(tile, gradients=None, bucket=None):
    """Median extra resident bytes of ZeRO-topo's pipeline-form step (steps 2-4) on this rank
    (:func:`_pipeline_engine`); and the planner's bound of what tiling removes
    (``zero_topo.perf.untiled_step_bytes``) for this rank's plan and parameters."""
    from ds_ext.bench import median
    from ds_ext.bench.tiled import measure_peak
    from ds_ext.zero_topo import perf

    engine = _pipeline_engine(tile, gradients, bucket)
    plugin = engine.ds_ext.plugin("zero_topo")
    peaks = []
    step = plugin.optimizer.step
    for i in range(4):
        measured = {}

        def measured_step(closure=None, measured=measured):
            measured["peak"], _, _ = measure_peak(step)

        plugin.optimizer.step = measured_step
        _train_batch(engine, i)
        if i >= 1:
            peaks.append(measured["peak"])
    shapes = [(p.numel(), p.dim()) for p in engine.module.parameters()]
    bound = perf.untiled_step_bytes(plugin.plan, [perf.unit_spec(plugin.plan, shapes)], engine.global_rank, True)
    units = plugin.sharded.unit_specs()
    engine.destroy()
    return {
        "peak": median(peaks),
        "bound": bound,
        "elements": bound / 12,
        "units": len(units),
        "reduction": max(perf.reduction_bytes(plugin.plan, u, 2, True, gloo=True) for u in units),
    }


def _reduction_peaks(gradients, bucket, bias, compiled):
    """Per unit, the extra resident bytes of its gradient reduction in the pipeline form's second
    step (``FlatUnit.reduce_gradients``; the first compiles the fused quantizer), and
    ``zero_topo.perf.reduction_bytes`` of the unit as the engine laid it out (gloo's reduce-scatter)."""
    from ds_ext.bench.tiled import measure_peak
    from ds_ext.zero_topo import perf

    engine = _pipeline_engine(None, gradients, bucket, bias, compiled)
    plugin = engine.ds_ext.plugin("zero_topo")
    units = plugin.sharded.all_units
    peaks = {}
    for unit in units:

        def measured(unit=unit, reduce=unit.reduce_gradients):
            peaks[unit.name], _, _ = measure_peak(reduce)

        unit.reduce_gradients = measured
    for i in range(2):
        _train_batch(engine, i)
    plan = plugin.plan
    model = [perf.reduction_bytes(plan, u, 2, compiled, gloo=True) for u in plugin.sharded.unit_specs()]
    out = {"plan": plan.describe(), "measured": [peaks[u.name] for u in units], "model": model}
    out["raw"] = [sum(u.raw_per_shard) for u in plugin.sharded.unit_specs()]
    engine.destroy()
    return out


REDUCTIONS = {  # gradients, reduce_bucket_size, biases, compile_quantizer: every path of reduction_bytes
    "int4-raw": (None, 2 * PIPE_HIDDEN * PIPE_HIDDEN, True, False),  # the default plan: 1 hop; + raw blocks
    "int4-fused": (None, PIPE_HIDDEN * PIPE_HIDDEN, False, True),
    "16-bit": ({"level": "gpu", "bits": 16, "hops": 1}, PIPE_HIDDEN * PIPE_HIDDEN, False, False),
    "int8-2hop-raw": ({"level": "gpu", "bits": 8, "hops": 2}, 2 * PIPE_HIDDEN * PIPE_HIDDEN, True, False),
    "int4-2hop-fused": ({"level": "gpu", "bits": 4, "hops": 2}, PIPE_HIDDEN * PIPE_HIDDEN, False, True),
}


def test_the_pipeline_form_reduction_is_at_most_its_model(world):
    """What ``ds-ext plan`` counts for the step's gradient reduction (``zero_topo.perf.reduction_bytes``,
    written from the code's buffers, not fitted): each unit's measured extra peak is at most the model,
    and the median unit's at least 85 % of it, on every path (16-bit reduce-scatter, quantized
    all-to-all in one hop and two, with raw blocks of biases and without, eager and fused quantizer).
    Each unit is one layer (with its bias), about 1M elements, 16 per case (4 ranks)."""
    from ds_ext.bench import median

    for case, (gradients, bucket, bias, compiled) in REDUCTIONS.items():
        ratios = []
        for r in world.run(_reduction_peaks, gradients, bucket, bias, compiled):
            assert len(r["model"]) == PIPE_LAYERS and (all(r["raw"]) if bias else not any(r["raw"])), (case, r)
            for got, model in zip(r["measured"], r["model"]):
                assert got <= model + SLACK, (case, r)
                ratios.append(got / model)
        assert median(ratios) >= 0.85, (case, ratios)


def test_tiling_removes_at_most_the_planners_bound_from_the_pipeline_form_step(world):
    """What ``ds-ext plan`` decides the tiled optimizer by (``megatron_plans.tiled_optimizer``):
    tiling lowers the extra peak of ZeRO-topo's pipeline-form step (fp16, 4 data-parallel ranks) by
    at most the planner's bound of its optimizer phase (fp32 up-cast + unscaled copy + a foreach
    Adam's temporary, 12 bytes per optimizer element), with the quantized default and with 16-bit
    gradients. Measured, it lowers it by nothing: the peak is the gradient reduction's, over the
    whole stage (4 x the optimizer slice here), at 9 and 3 bytes per parameter, above the optimizer
    phase's 8 bytes per optimizer element (2 per parameter)."""
    for grads in (None, {"level": "gcd", "bits": 16, "hops": 1}):
        untiled = world.run(_pipeline_step_peak, None, grads)
        tiled = world.run(_pipeline_step_peak, MEM_TILE, grads)
        for u, t in zip(untiled, tiled):
            assert u["peak"] - t["peak"] <= u["bound"], (grads, u, t)
            assert u["peak"] > 8 * u["elements"] + SLACK, (grads, u)  # the reduction's, above the optimizer's


def test_reduce_bucket_size_bounds_the_pipeline_form_steps_reduction(world):
    """``zero_optimization.reduce_bucket_size`` of one layer's elements cuts the stage into 4 units
    (ds_ext.zero_topo.pipeline), reduced one at a time: the step's extra peak falls from the whole
    stage's reduction (above) to the larger of one unit's reduction (9 / 3 bytes per element with int4
    / 16-bit gradients, measured above) and the optimizer phase (at most 8 bytes per optimizer
    element), at most a third of the one-unit peak with int4 and a half with 16-bit; and with the
    reduction bounded, tiling (16-bit) lowers the peak by more than a byte per optimizer element."""
    layer = PIPE_HIDDEN * PIPE_HIDDEN
    for grads, per_element in ((None, 9.5), ({"level": "gcd", "bits": 16, "hops": 1}, 3.5)):
        whole = world.run(_pipeline_step_peak, None, grads)
        bucketed = world.run(_pipeline_step_peak, None, grads, layer)
        for w, b in zip(whole, bucketed):
            assert (w["units"], b["units"]) == (1, PIPE_LAYERS)
            assert b["reduction"] <= per_element * layer, (grads, b)  # the model, as measured above
            assert b["peak"] <= max(b["reduction"], 8 * b["elements"]) + SLACK, (grads, b)
            assert b["peak"] <= w["peak"] / (3 if grads is None else 2), (grads, w, b)
        if grads is not None:
            tiled = world.run(_pipeline_step_peak, MEM_TILE, grads, layer)
            for b, t in zip(bucketed, tiled):
                assert t["peak"] < b["peak"] - b["elements"], (b, t)  # tiling now removes its share
