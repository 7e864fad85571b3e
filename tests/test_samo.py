"""SAMO (001 ch. 4): compressed model states of a pruned model, compressed all-reduce.

Reference everywhere: masked dense training written here with plain torch, sharing no code with
``ds_ext.samo``: the same 4-layer MLP pruned by ``torch.nn.utils.prune`` (weight = weight_orig *
weight_mask, so the dense gradient of weight_orig is zero where pruned and the dense norm is the
norm over the kept entries), ``torch.optim.Adam`` / ``AdamW`` on the dense parameters, torch's
``clip_grad_norm_``, the batches of every data-parallel rank and micro-batch summed serially, and
the mask re-applied to ``weight_orig`` after each step. SAMO runs through ``ds_ext.initialize`` on
gloo worlds of 1, 2 and 4 ranks (each started once for the module) and on a 2-stage
PipelineEngine, at ZeRO stages 0, 1 and 2; every parameter must equal the reference within 1e-6 in
fp32 after 20 steps, the pruned entries exactly zero. The state bytes SAMO holds equal Eq. 4.1, term by term; the ledger's
all-reduce bytes equal (1 - p) of what DeepSpeed's own dense stage-0 engine sends for the same
model, booked by the same ledger. Beside the tiled optimizer (001 §7.2) the same runs, with tile
boundaries inside the parameters, must equal untiled SAMO's bit for bit, and the state bytes the
tiled Eq. 4.1.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils import prune

from ds_ext.local_world import World

TOPOLOGY = {"preset": "frontier", "sizes": {"gcd": 1, "gpu": 1}, "emulate": True}  # one rank per node
DIMS = (16, 32, 32, 32, 8)
SPARSITY = 0.8
MICRO, ACCUM, STEPS, LR, WD, CLIP = 4, 2, 20, 1e-2, 0.1, 0.15
FP32 = {"rtol": 1e-6, "atol": 1e-6}


# ---- the model, its masks and the data (shared by SAMO's runs and the reference) -------------
def layer_mask(i: int, shape: tuple[int, int]) -> torch.Tensor:
    """Layer ``i``'s mask: exactly round((1 - SPARSITY) n) kept entries, drawn from a seeded generator."""
    n = shape[0] * shape[1]
    keep = torch.randperm(n, generator=torch.Generator().manual_seed(7 + i))[: round((1 - SPARSITY) * n)]
    mask = torch.zeros(n, dtype=torch.bool)
    mask[keep] = True
    return mask.view(shape)


class Layer(nn.Module):
    """Linear (+ tanh but for the last layer), initialised from its own seed (the same on every
    rank and in every stage layout) and pruned by ``torch.nn.utils.prune.custom_from_mask``."""

    def __init__(self, i: int, bias: bool = True) -> None:
        super().__init__()
        d_in, d_out = DIMS[i], DIMS[i + 1]
        self.fc, self.last = nn.Linear(d_in, d_out, bias=bias), i == len(DIMS) - 2
        g = torch.Generator().manual_seed(1000 + i)
        with torch.no_grad():
            self.fc.weight.copy_(torch.randn(d_out, d_in, generator=g) / d_in**0.5)
            if bias:
                self.fc.bias.copy_(torch.randn(d_out, generator=g) * 0.1)
        prune.custom_from_mask(self.fc, "weight", layer_mask(i, (d_out, d_in)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        return y if self.last else torch.tanh(y)


def mlp(bias: bool = True) -> nn.Sequential:
    return nn.Sequential(*[Layer(i, bias) for i in range(len(DIMS) - 1)])


def mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out.float() - y) ** 2).mean()


def batch(step: int, data_rank: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100_000 * step + 100 * data_rank + micro)
    return torch.randn(MICRO, DIMS[0], generator=g), torch.randn(MICRO, DIMS[-1], generator=g)


OPTIMIZERS = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam}


def reference(dp: int, optimizer: str = "adamw", steps: int = STEPS, bias: bool = True) -> dict:
    """Masked dense training (module docstring): weights by name, global norms per step."""
    model = mlp(bias)
    opt = OPTIMIZERS[optimizer](model.parameters(), lr=LR, weight_decay=WD)
    norms = []
    for step in range(steps):
        opt.zero_grad()
        for m in range(ACCUM):
            for r in range(dp):
                x, y = batch(step, r, m)
                (mse(model(x), y) / (ACCUM * dp)).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
        with torch.no_grad():
            for layer in model:
                layer.fc.weight_orig.mul_(layer.fc.weight_mask)
    weights = {}
    for i, layer in enumerate(model):
        weights[f"{i}.fc.weight"] = (layer.fc.weight_orig * layer.fc.weight_mask).detach()
        if bias:
            weights[f"{i}.fc.bias"] = layer.fc.bias.detach().clone()
    return {"weights": weights, "norms": norms}


# ---- SAMO through ds_ext.initialize (run on every rank) -------------------------------------------
def _train(
    optimizer: str = "adamw",
    stages: int = 0,
    precision: str = "fp32",
    steps: int = STEPS,
    bias: bool = True,
    samo: dict | None = None,
    zero: int = 0,
    bucket: int | None = None,
    scale_power: int = 8,
    tiled: int | None = None,
) -> dict:
    """Train with SAMO (``samo`` None: DeepSpeed's dense engine on the pruned model, for the ledger
    baseline and DeepSpeed's own ZeRO-1); ``stages`` > 0: a PipelineModule of that many stages on the
    PipelineEngine; ``zero``: the ds_config's ZeRO stage, ``bucket`` its ``reduce_bucket_size``;
    ``scale_power``: fp16's initial loss scale 2^scale_power; ``tiled``: beside the tiled optimizer,
    of that tile size."""
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    import ds_ext
    from ds_ext.integration import ds_engine

    ds_engine.init_distributed()
    get_accelerator().is_fp16_supported = lambda: True  # torch's fp16 CPU arithmetic serves this model
    world = dist.get_world_size()
    if stages:
        from deepspeed.pipe import LayerSpec, PipelineModule

        model = PipelineModule(
            [LayerSpec(Layer, i, bias) for i in range(len(DIMS) - 1)],
            num_stages=stages,
            loss_fn=mse,
            partition_method="uniform",
        )
    else:
        model = mlp(bias)
    dp = world // max(stages, 1)
    cfg = {
        "train_batch_size": MICRO * ACCUM * dp,
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": CLIP,
        "steps_per_print": 10**9,
        "ds_ext": {"topology": TOPOLOGY},
        "zero_optimization": {"stage": zero, **({"reduce_bucket_size": bucket} if bucket else {})},
        "zero_allow_untested_optimizer": True,  # torch's AdamW under DeepSpeed's own ZeRO-1
    }
    if precision != "fp32":
        cfg[precision] = {"enabled": True, **({"initial_scale_power": scale_power} if precision == "fp16" else {})}
    if samo is not None:
        cfg["ds_ext"]["samo"] = {"enabled": True, **samo}
    if tiled is not None:
        cfg["ds_ext"]["tiled_optimizer"] = {"enabled": True, "tile_size": tiled}
    opt = OPTIMIZERS[optimizer](model.parameters(), lr=LR, weight_decay=WD)
    engine, *_ = ds_ext.initialize(model=model, optimizer=opt, config=cfg)
    dtype = next(engine.module.parameters()).dtype
    data_rank = engine.grid.get_data_parallel_rank() if stages else dist.get_rank()
    norms = []
    for step in range(steps):
        if stages:
            engine.train_batch(iter([batch(step, data_rank, m) for m in range(ACCUM)]))
        else:
            for m in range(ACCUM):
                x, y = batch(step, data_rank, m)
                engine.backward(mse(engine(x.to(dtype)), y))
                engine.step()
        norm = engine.get_global_grad_norm()  # None for DeepSpeed's dense engine (the ledger baseline)
        norms.append(None if norm is None else float(norm))
    weights = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    for name, buf in engine.module.named_buffers():  # DeepSpeed's dense engine: weight = weight_orig x mask
        if name.endswith("weight_mask"):
            weights[name.removesuffix("_mask")] = weights.pop(name.removesuffix("_mask") + "_orig") * buf
    traffic: dict[tuple[str, str], float] = {}  # (phase, op) -> the last step's ledger bytes
    for (phase, op, _), b in engine.ds_ext.ledger.steps[-1].bytes.items():
        traffic[phase, op] = traffic.get((phase, op), 0.0) + b
    out = {
        "rank": dist.get_rank(),
        "weights": weights,
        "norms": norms,
        "allreduce": sum(b for (_, op), b in traffic.items() if op == "all_reduce"),
        "traffic": traffic,
    }
    if samo is not None:
        plugin = engine.ds_ext.plugin("samo")
        out |= {
            "state_bytes": plugin.state_bytes(),
            "analytic_state_bytes": plugin.analytic_state_bytes(),
            "analytic_allreduce": plugin.analytic_allreduce_bytes(),
            "phi": plugin.grads.phi,
            "kept": plugin.grads.kept,
            "describe": plugin.describe(),
            "loss_scale": float(engine.optimizer.loss_scale),
            "skipped": engine.skipped_steps,
            "buffers": [t.numel() for t in plugin.grads.buffers()],
            "shard_size": plugin.grads.shard_size,
            "masters": [m.numel() for m in plugin.optimizer.masters],
        }
    if tiled is not None:
        out["tiles"] = engine.ds_ext.plugin("tiled_optimizer").tiled.buffer.tiles_processed
    engine.destroy()
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def worlds():
    """Gloo worlds of 1, 2 and 4 ranks, each started once for the module on first use."""
    started: dict[int, World] = {}

    def get(n: int) -> World:
        if n not in started:
            started[n] = World(n)
        return started[n]

    yield get
    for w in started.values():
        w.close()


def _assert_equals_reference(runs: list[dict], ref: dict) -> None:
    for run in runs:
        assert run["norms"] == pytest.approx(ref["norms"], rel=1e-5, abs=0)
        for name, want in ref["weights"].items():
            got = run["weights"].get(name)
            if got is None:  # a pipeline stage holds only its layers
                continue
            torch.testing.assert_close(got, want, **FP32, msg=name)
            if name.endswith("weight"):
                i = int(name.split(".")[0])
                pruned = ~layer_mask(i, tuple(want.shape))
                assert torch.count_nonzero(got[pruned]) == 0, name  # exactly zero, not small
    assert max(ref["norms"]) > CLIP  # the clip is active


# ---- equality to masked dense training ----------------------------------------------------------
@pytest.mark.parametrize("dp", [1, 2, 4])
def test_samo_equals_masked_dense_adamw_on_data_parallel_ranks(worlds, dp):
    """AdamW with weight decay, clipping active, GA 2, 20 steps: every parameter of every rank equals
    the reference within 1e-6 (fp32), the global norms too, the pruned entries exactly zero."""
    runs = worlds(dp).run(_train, samo={})
    _assert_equals_reference(runs, reference(dp))
    names = {n for r in runs for n in r["weights"]}
    assert names == set(reference(1, steps=0)["weights"])


def test_samo_equals_masked_dense_adam_with_l2_decay(worlds):
    """Adam (L2 weight decay in the gradient, on the compressed masters) on 2 ranks."""
    _assert_equals_reference(worlds(2).run(_train, "adam", samo={}), reference(2, "adam"))


def test_samo_on_a_two_stage_pipeline_engine_equals_masked_dense(worlds):
    """A PipelineModule of 2 stages x 2 data-parallel ranks on DeepSpeed's PipelineEngine: each stage's
    parameters equal the reference's (norm summed over the stages, all-reduce over each stage's data
    group)."""
    runs = worlds(4).run(_train, stages=2, samo={})
    _assert_equals_reference(runs, reference(2))
    assert {n.split(".")[0] for n in runs[0]["weights"]} == {"0", "1"}
    assert {n.split(".")[0] for n in runs[-1]["weights"]} == {"2", "3"}


def test_zero1_shards_equal_deepspeeds_zero1_and_masked_dense(worlds):
    """ZeRO stage 1 on 2 ranks (the compressed optimizer state sharded, one shard boundary inside a
    parameter and one entry of padding): every parameter equals DeepSpeed's own ZeRO-1 training the
    pruned model densely (its masks applied in forward) and the serial reference within 1e-6 (fp32),
    the pruned entries exactly zero; the same on a 2-stage PipelineEngine x 2 data ranks; in bf16 each rank holds what
    ``ds_ext.perf.samo.sharded_model_state_bytes`` predicts, its half of θ32 and os."""
    from ds_ext.perf import samo as model

    runs = worlds(2).run(_train, samo={}, zero=1)
    theirs = worlds(2).run(_train, zero=1)
    _assert_equals_reference(runs, reference(2))
    for ours, deepspeed in zip(runs, theirs):
        assert ours["weights"].keys() == deepspeed["weights"].keys()
        for name, want in deepspeed["weights"].items():
            torch.testing.assert_close(ours["weights"][name], want, **FP32, msg=name)
    assert runs[0]["kept"] % 2 == 1  # a padded entry
    _assert_equals_reference(worlds(4).run(_train, stages=2, samo={}, zero=1), reference(2))  # PP 2 x data 2
    bf16 = worlds(2).run(_train, precision="bf16", steps=2, bias=False, samo={}, zero=1)
    for rank, run in enumerate(bf16):
        phi, k = run["phi"], run["kept"]
        want = model.sharded_model_state_bytes(phi, k, k, 2, 2, rank)
        assert sum(run["state_bytes"].values()) == want == run["analytic_state_bytes"]
        own = min(max(k - rank * (-(-k // 2)), 0), -(-k // 2))
        assert run["state_bytes"]["masters"] == 4 * own and run["state_bytes"]["optimizer"] == 8 * own


def _zero_checkpoint_error(save_dir: str, stage: int) -> tuple[str, str] | None:
    import ds_ext
    from ds_ext.integration import ds_engine

    ds_engine.init_distributed()
    model = mlp()
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": stage},
        "ds_ext": {"topology": TOPOLOGY, "samo": {"enabled": True}},
    }
    engine, *_ = ds_ext.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=cfg)
    try:
        engine.save_checkpoint(save_dir)
    except Exception as err:  # noqa: BLE001 - the test inspects the type and message
        return type(err).__name__, str(err)
    finally:
        engine.destroy()
    return None


@pytest.mark.parametrize("stage", [1, 2])
def test_sharded_checkpoints_are_refused_on_every_rank(worlds, tmp_path, stage):
    message = (
        f"ds_ext.samo with zero_optimization.stage {stage}: saving or loading the sharded compressed optimizer state "
        "is not implemented; allowed: zero_optimization.stage 0 for checkpoints"
    )
    got = worlds(2).run(_zero_checkpoint_error, str(tmp_path), stage, timeout=120)
    assert got == [("DsExtConfigError", message)] * 2


# ---- ZeRO-2: the compressed gradients sharded, reduced in buckets during backward -----------------
BUCKET = 96  # reduce_bucket_size (elements): 3 buffers of 32 entries (2 x 16, 4 x 8); 1.fc.weight spans 7-8 buckets


@pytest.mark.parametrize("dp", [2, 4])
def test_zero2_equals_masked_dense_with_bucketed_reduction(worlds, dp):
    """ZeRO-2 on 2 and 4 ranks (AdamW with weight decay, clipping active, GA 2, 20 steps): every
    parameter equals the serial reference within 1e-6 (fp32), the pruned entries exactly zero; each
    rank holds its shard of s = ceil(k / d) and three buckets of d x (BUCKET // 3 d) entries, never the
    full flat buffer of d s; the reduce-scatters, all in backward, carry w d s (d - 1) / d bytes per
    micro-batch although each layer's bias, before its weight in the layout, reaches its hook first."""
    from ds_ext.comm.ledger import reduce_scatter_bytes

    runs = worlds(dp).run(_train, samo={}, zero=2, bucket=BUCKET)
    _assert_equals_reference(runs, reference(dp))
    for run in runs:
        per_micro = reduce_scatter_bytes(4 * dp * run["shard_size"], dp)
        assert run["traffic"][("backward", "reduce_scatter")] == pytest.approx(ACCUM * per_micro, rel=1e-12)
        assert ("step", "reduce_scatter") not in run["traffic"]
        s = run["shard_size"]
        assert s == -(-run["kept"] // dp) and run["buffers"] == [s, BUCKET]
        assert sum(run["buffers"]) < dp * s  # below the ZeRO-1 flat buffer alone


def test_zero2_state_bytes_ledger_and_bf16(worlds):
    """bf16, no biases, 2 and 4 ranks: the bytes each rank holds at the step's peak equal
    ``zero2_model_state_bytes`` (gradients term 2 s + 2 x 3 d m: the shard and the three buckets, reduce_bucket_size together); the ledger's
    reduce-scatter bytes are booked in backward, w d s (d - 1) / d per micro-batch: GA x ZeRO-1's one,
    (1 - p) of the dense φ up to fewer than d padded entries; the step all-gathers the shard once and
    all-reduces nothing but the norm's one fp64 scalar."""
    from ds_ext.comm.ledger import all_gather_bytes, all_reduce_bytes, reduce_scatter_bytes
    from ds_ext.perf import samo as model

    for dp in (2, 4):
        for rank, run in enumerate(
            worlds(dp).run(_train, precision="bf16", steps=2, bias=False, samo={}, zero=2, bucket=BUCKET)
        ):
            phi, k, s = run["phi"], run["kept"], run["shard_size"]
            m = model.bucket_piece(k, dp, BUCKET)
            want = model.zero2_model_state_bytes(phi, k, k, 2, dp, rank, BUCKET)
            assert sum(run["state_bytes"].values()) == want == run["analytic_state_bytes"]
            assert (
                run["state_bytes"]["gradients"] == 2 * s + 2 * 3 * dp * m == 2 * s + 2 * BUCKET
                and run["state_bytes"]["copies"] == 0
            )
            assert run["state_bytes"]["gradients_fp32"] == 4 * s
            per_micro = reduce_scatter_bytes(2 * dp * s, dp)
            assert run["traffic"][("backward", "reduce_scatter")] == pytest.approx(ACCUM * per_micro, rel=1e-12)
            assert ("step", "reduce_scatter") not in run["traffic"]
            assert per_micro == pytest.approx(k / phi * reduce_scatter_bytes(2 * phi, dp), rel=dp / k)
            assert run["traffic"][("step", "all_gather")] == all_gather_bytes(2 * s, dp)
            assert run["allreduce"] == all_reduce_bytes(8, dp)
            analytic = model.zero2_reduction_bytes(dp * s, 2, dp, ACCUM)
            assert run["analytic_allreduce"][0] == pytest.approx(analytic, rel=1e-12)
            assert analytic == pytest.approx(per_micro * ACCUM + all_gather_bytes(2 * s, dp), rel=1e-12)
    runs = worlds(2).run(_train, precision="bf16", samo={}, zero=2, bucket=BUCKET)
    ref, init = reference(2)["weights"], reference(2, steps=0)["weights"]
    for run in runs:
        for name, want in ref.items():
            got = run["weights"][name]
            assert got.dtype == torch.bfloat16
            if name.endswith("weight"):
                kept = layer_mask(int(name.split(".")[0]), tuple(want.shape))
                assert torch.count_nonzero(got[~kept]) == 0, name
                assert (got.float()[kept] != init[name][kept].to(torch.bfloat16).float()).float().mean() > 0.9
            torch.testing.assert_close(got.float(), want, rtol=0, atol=3e-2, msg=name)
    for name in runs[0]["weights"]:
        assert torch.equal(runs[0]["weights"][name], runs[1]["weights"][name]), name


def test_zero2_fp16_overflow_skips_the_step_on_every_rank(worlds):
    """fp16 from a loss scale of 2^24: the first steps overflow (an inf in the shards), every rank
    skips the same steps and lowers the same scale, and the ranks end with the same weights, the
    pruned entries exactly zero."""
    runs = worlds(4).run(_train, precision="fp16", samo={}, zero=2, bucket=BUCKET, scale_power=24)
    assert runs[0]["skipped"] > 0
    assert {(r["skipped"], r["loss_scale"]) for r in runs} == {(runs[0]["skipped"], runs[0]["loss_scale"])}
    assert runs[0]["skipped"] < STEPS
    for run in runs:
        for name, got in run["weights"].items():
            assert torch.equal(got, runs[0]["weights"][name]), name
            if name.endswith("weight"):
                assert torch.count_nonzero(got[~layer_mask(int(name.split(".")[0]), tuple(got.shape))]) == 0


# ---- memory (Eq. 4.1) and communication (§4.2.1) ------------------------------------------------
def test_measured_state_bytes_equal_eq_4_1(worlds):
    """bf16, every parameter masked (no biases): the bytes of every tensor SAMO holds at the step's
    peak equal Eq. 4.1 term by term, 24 k + 2 φ in all; in fp32 the up-cast gradient and the 16-bit
    copy are the fp32 tensors themselves."""
    from ds_ext.perf import samo as model

    (bf16,) = worlds(1).run(_train, precision="bf16", steps=2, bias=False, samo={})
    phi, k = bf16["phi"], bf16["kept"]
    assert phi == sum(DIMS[i] * DIMS[i + 1] for i in range(len(DIMS) - 1))
    assert k == sum(round((1 - SPARSITY) * DIMS[i] * DIMS[i + 1]) for i in range(len(DIMS) - 1))
    assert bf16["state_bytes"] == {
        "weights": 2 * phi,
        "gradients": 2 * k,
        "gradients_fp32": 4 * k,
        "masters": 4 * k,
        "optimizer": 8 * k,
        "indices": 4 * k,
        "copies": 2 * k,
    }
    assert sum(bf16["state_bytes"].values()) == 24 * k + 2 * phi == model.model_state_bytes(phi, k)
    assert bf16["analytic_state_bytes"] == 24 * k + 2 * phi
    (fp32,) = worlds(1).run(_train, steps=2, bias=False, samo={})
    assert sum(fp32["state_bytes"].values()) == 4 * phi + 20 * k == fp32["analytic_state_bytes"]


def test_allreduce_carries_the_kept_fraction_of_deepspeeds_dense_bytes(worlds):
    """4 data-parallel ranks, no biases: the ledger's all-reduce bytes of a SAMO step are (1 - p) of the
    gradient bytes DeepSpeed's own dense stage-0 engine sends for the same model (booked by the same
    ledger from torch.distributed), and equal the analytic model; no index travels."""
    from ds_ext.comm.ledger import all_reduce_bytes

    samo = worlds(4).run(_train, steps=2, bias=False, samo={})
    dense = worlds(4).run(_train, steps=2, bias=False)
    for s, d in zip(samo, dense):
        kept_fraction = s["kept"] / s["phi"]
        assert kept_fraction == pytest.approx(1 - SPARSITY, abs=1e-3)
        # DeepSpeed also all-reduces its clipping norm, one fp32 scalar averaged over the data group
        # (runtime/utils.py clip_grad_norm_); SAMO's ranks hold the all-reduced gradients and need none
        dense_gradients = d["allreduce"] - all_reduce_bytes(4, 4)
        assert dense_gradients == pytest.approx(s["analytic_allreduce"][1], rel=1e-12)
        assert s["allreduce"] == pytest.approx(s["analytic_allreduce"][0], rel=1e-12)
        assert s["allreduce"] == pytest.approx(kept_fraction * dense_gradients, rel=1e-12)


# ---- 16-bit training -------------------------------------------------------------------------------
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_sixteen_bit_training_keeps_pruned_entries_zero_and_follows_fp32(worlds, precision):
    """bf16 and fp16 (DeepSpeed's dynamic loss scaler) on 2 ranks: the pruned entries stay exactly
    zero, the kept weights move, and the weights follow the fp32 reference within 16-bit rounding."""
    runs = worlds(2).run(_train, precision=precision, samo={})
    ref = reference(2)
    init = reference(2, steps=0)["weights"]
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    for run in runs:
        for name, want in ref["weights"].items():
            got = run["weights"][name]
            assert got.dtype == dtype
            if name.endswith("weight"):
                kept = layer_mask(int(name.split(".")[0]), tuple(want.shape))
                assert torch.count_nonzero(got[~kept]) == 0, name
                moved = got.float()[kept] != init[name][kept].to(dtype).float()
                assert moved.float().mean() > 0.9, name  # a few land on their initial 16-bit value
            torch.testing.assert_close(got.float(), want, rtol=0, atol=3e-2, msg=name)
    if precision == "fp16":
        assert runs[0]["loss_scale"] > 1.0


# ---- beside the tiled optimizer (001 §7.2) ---------------------------------------------------------
TILE = 48  # tile boundaries inside the 102- and 205-entry masters (and ZeRO-1's pieces); biases fit one tile
TILE2 = 5  # ZeRO-2's masters are the bucket pieces (16 entries at most): boundaries inside them


def _assert_bit_identical(tiled: list[dict], untiled: list[dict], tile: int = TILE) -> None:
    """The tiled runs' parameters, norms, loss scales and skipped steps are the untiled runs', bit for bit,
    and some tile boundary fell inside a master."""
    for t, u in zip(tiled, untiled, strict=True):
        assert t["norms"] == u["norms"]
        assert (t["loss_scale"], t["skipped"]) == (u["loss_scale"], u["skipped"])
        assert t["weights"].keys() == u["weights"].keys()
        for name, want in u["weights"].items():
            assert torch.equal(t["weights"][name], want), name
        assert max(t["masters"]) > tile and t["tiles"] > STEPS * len(t["masters"])


@pytest.mark.parametrize(
    "dp, zero", [(1, 0), (2, 0), (2, 1), (2, 2), (4, 2)], ids=["dp1", "dp2", "dp2-zero1", "dp2-zero2", "dp4-zero2"]
)
def test_tiled_samo_is_untiled_samo_bit_for_bit_and_masked_dense(worlds, dp, zero):
    """AdamW with weight decay, clipping active, GA 2, 20 steps, the step in tiles of 48 entries: every
    parameter equals untiled SAMO's bit for bit (the clip coefficient too: the same norms) and masked
    dense training within 1e-6 (fp32), the pruned entries exactly zero; on 1 and 2 data-parallel ranks,
    at ZeRO stage 1 on 2 and at ZeRO stage 2 (the shard stepped in tiles of 5, then gathered bucket by
    bucket) on 2 and 4."""
    bucket, tile = (BUCKET, TILE2) if zero == 2 else (None, TILE)
    tiled = worlds(dp).run(_train, samo={}, zero=zero, bucket=bucket, tiled=tile)
    _assert_equals_reference(tiled, reference(dp))
    _assert_bit_identical(tiled, worlds(dp).run(_train, samo={}, zero=zero, bucket=bucket), tile)


def test_tiled_samo_on_a_two_stage_pipeline_engine_is_untiled_samo_bit_for_bit(worlds):
    """2 stages x 2 data-parallel ranks on the PipelineEngine (the norm summed over the stages before
    the first tile): bit for bit untiled SAMO's, and masked dense training within 1e-6."""
    tiled = worlds(4).run(_train, stages=2, samo={}, tiled=TILE)
    _assert_equals_reference(tiled, reference(2))
    _assert_bit_identical(tiled, worlds(4).run(_train, stages=2, samo={}))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_tiled_samo_in_sixteen_bit_is_untiled_samo_bit_for_bit(worlds, precision):
    """bf16, and fp16 with DeepSpeed's loss scaler (the tiles unscale by s), on 2 ranks: bit for bit
    untiled SAMO's, the pruned entries exactly zero."""
    tiled = worlds(2).run(_train, precision=precision, samo={}, tiled=TILE)
    _assert_bit_identical(tiled, worlds(2).run(_train, precision=precision, samo={}))
    for run in tiled:
        for name, got in run["weights"].items():
            if name.endswith("weight"):
                assert torch.count_nonzero(got[~layer_mask(int(name.split(".")[0]), tuple(got.shape))]) == 0, name


def test_tiled_state_bytes_equal_the_tiled_eq_4_1_below_untiled(worlds):
    """bf16, no biases: ∇θ32 is the 4 x tile_size buffer and the 16-bit copy one tile's (2 x 48 bytes),
    every other term Eq. 4.1's; the sum is ``tiled_model_state_bytes``, below untiled SAMO's 24 k + 2 φ;
    at ZeRO stages 1 and 2 on 2 ranks each rank's sum is ``tiled_shard_bytes`` of the untiled sharded
    one, below it; in fp32 the buffer is the one term the tiles add (∇θ32 is ∇θ16 there)."""
    from ds_ext.perf import samo as model

    (bf16,) = worlds(1).run(_train, precision="bf16", steps=2, bias=False, samo={}, tiled=TILE)
    phi, k, largest = bf16["phi"], bf16["kept"], max(bf16["masters"])
    assert bf16["state_bytes"] == {
        "weights": 2 * phi,
        "gradients": 2 * k,
        "gradients_fp32": 4 * TILE,
        "masters": 4 * k,
        "optimizer": 8 * k,
        "indices": 4 * k,
        "copies": 2 * TILE,
    }
    want = model.tiled_model_state_bytes(phi, k, k, 2, TILE, largest)
    assert sum(bf16["state_bytes"].values()) == want == bf16["analytic_state_bytes"]
    assert want < model.model_state_bytes(phi, k) == 24 * k + 2 * phi
    for zero, bucket in [(1, None), (2, BUCKET)]:
        runs = worlds(2).run(
            _train, precision="bf16", steps=2, bias=False, samo={}, zero=zero, bucket=bucket, tiled=TILE
        )
        for rank, run in enumerate(runs):
            if zero == 1:
                untiled = model.sharded_model_state_bytes(phi, k, k, 2, 2, rank)
            else:
                untiled = model.zero2_model_state_bytes(phi, k, k, 2, 2, rank, BUCKET)
            want = model.tiled_shard_bytes(untiled, k, 2, 2, TILE)
            assert want == untiled - 4 * -(-k // 2) + 4 * TILE < untiled
            assert sum(run["state_bytes"].values()) == want == run["analytic_state_bytes"], (zero, rank)
            assert run["state_bytes"]["gradients_fp32"] == 4 * TILE
    (fp32,) = worlds(1).run(_train, steps=2, bias=False, samo={}, tiled=TILE)
    assert sum(fp32["state_bytes"].values()) == 4 * phi + 20 * k + 4 * TILE == fp32["analytic_state_bytes"]


# ---- pure logic: the index, the masks, the analytic model ----------------------------------------------
def test_the_index_is_the_one_dimensional_view_of_the_kept_entries():
    from ds_ext.samo.index import compress, expand, flat_index

    mask = torch.tensor([[True, False], [False, True]])  # 001 §4.1.2's example: (0, 0), (1, 1) -> [0, 3]
    index = flat_index(mask)
    assert index.dtype == torch.int32 and index.tolist() == [0, 3]
    dense = torch.arange(1.0, 5.0).view(2, 2)
    assert compress(dense, index).tolist() == [1.0, 4.0]
    out = torch.full((2, 2), 9.0)
    expand(torch.tensor([5.0, 6.0]), index, out)
    assert out.tolist() == [[5.0, 0.0], [0.0, 6.0]]
    big = torch.rand(3, 5, 7) > 0.7
    values = torch.randn(3, 5, 7) * big
    again = torch.empty_like(values)
    expand(compress(values, flat_index(big)), flat_index(big), again)
    assert torch.equal(again, values)


def test_masks_from_prune_buffers_zeros_and_a_file(tmp_path):
    from ds_ext.errors import DsExtConfigError
    from ds_ext.samo.mask import read_masks

    model = mlp()
    masks = read_masks(model, "prune")
    assert len(masks) == 4 and not any(hasattr(layer.fc, "weight_mask") for layer in model)
    for i, layer in enumerate(model):  # permanent: the weight has its zeros, the mask is the buffer's
        assert torch.equal(masks[layer.fc.weight], layer_mask(i, tuple(layer.fc.weight.shape)))
        assert torch.equal(layer.fc.weight != 0, masks[layer.fc.weight])
    zeros = read_masks(model, "zeros")  # the zeros of the weights; 1-d biases kept whole
    assert set(zeros) == set(masks) and all(torch.equal(zeros[p], masks[p]) for p in masks)
    path = tmp_path / "mask.pt"
    torch.save({"1.fc.weight": masks[model[1].fc.weight]}, path)
    assert list(read_masks(model, "file", str(path))) == [model[1].fc.weight]
    torch.save({"1.fc.weights": masks[model[1].fc.weight]}, path)
    with pytest.raises(DsExtConfigError, match=r"names '1.fc.weights', which is no parameter of the model"):
        read_masks(model, "file", str(path))
    with pytest.raises(DsExtConfigError, match=r"ds_ext.samo.mask 'file' needs ds_ext.samo.mask_file"):
        read_masks(model, "file")


def test_analytic_model_reproduces_eq_4_1_to_4_5_and_fig_4_2():
    from ds_ext.perf import samo as model

    phi = 10**9
    for p in (0.0, 0.25, 0.5, 0.8, 0.9):
        k = round((1 - p) * phi)
        assert model.model_state_bytes(phi, k) == 18 * k + 4 * k + 2 * phi + 2 * k  # Eq. 4.1
        assert model.model_state_bytes_at(phi, p) == pytest.approx(24 * (1 - p) * phi + 2 * phi)  # Eq. 4.3
        assert model.model_state_bytes_at(phi, p) == pytest.approx(
            model.default_model_state_bytes(phi) - (24 * p - 6) * phi  # Eq. 4.5
        )
    assert model.memory_saved(0.25) == pytest.approx(0.0)  # break-even (001 §4.1.4)
    assert round(model.memory_saved(0.8), 2) == 0.66 and round(model.memory_saved(0.9), 2) == 0.78
    assert model.allreduce_bytes(200, 2, 4) == 2 * 400 * 3 / 4
    assert model.bubble_time(1.0, 2.0, 3) == pytest.approx(2.0)  # Fig. 4.3: 2 forwards + 2 backwards


def test_split_takes_fewer_stages_and_more_data_parallelism_with_samo():
    """§4.2.2: GPT-3 XL-sized (1.3 B) state on 16 GB devices over 64 GPUs: dense training needs 2
    stages (20 φ = 26 GB), SAMO at p = 0.9 fits one (4.7 φ = 6.1 GB), so G_data doubles and each GPU
    sends half the pipeline messages (Eq. 4.9) with no bubble (Eq. 4.7)."""
    from ds_ext.perf import samo as model

    dense = model.choose_split(1_300_000_000, None, 64, 16e9, 512, 1)
    ours = model.choose_split(1_300_000_000, 0.9, 64, 16e9, 512, 1)
    assert (dense.inter, dense.data) == (2, 32) and (ours.inter, ours.data) == (1, 64)
    assert ours.messages_per_gpu == dense.messages_per_gpu / 2 and ours.bubble_fraction == 0.0
    assert model.choose_split(1_300_000_000, None, 64, 1e8, 512, 1) is None


def test_config_errors_name_the_key():
    from ds_ext import config
    from ds_ext.errors import DsExtConfigError

    assert config.parse({"samo": {"enabled": True}}).samo.model_dump() == {
        "enabled": True,
        "mask": "prune",
        "mask_file": None,
    }
    for block, message in [
        ({"mask": "magnitude"}, "ds_ext.samo.mask: Input should be 'prune', 'zeros' or 'file' (got 'magnitude')"),
        ({"sparsity": 0.9}, "ds_ext.samo.sparsity: unknown key; allowed keys: enabled, mask, mask_file"),
    ]:
        with pytest.raises(DsExtConfigError) as err:
            config.parse({"samo": {"enabled": True, **block}})
        assert str(err.value) == message


# ---- refusals, one line each, before training --------------------------------------------------------
OTHER_PLUGINS = ("zero_topo", "ted", "pmm3d", "pccl", "goldfish")  # refused beside SAMO, with or without tiles
TILED = {"tiled_optimizer": {"enabled": True}}


def _initialize_error(extra: dict, optimizer: str = "adamw", model_kind: str = "mlp") -> tuple[str, str] | None:
    import ds_ext
    from ds_ext.integration import ds_engine

    ds_engine.init_distributed()
    if model_kind in ("tied", "pipe"):
        from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

        specs = [TiedLayerSpec("t", nn.Linear, 8, 8) if model_kind == "tied" else LayerSpec(Layer, i) for i in range(2)]
        model = PipelineModule(specs, num_stages=2, loss_fn=mse)
    else:
        model = mlp() if model_kind == "mlp" else nn.Linear(4, 4)
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO,
        "steps_per_print": 10**9,
        **{k: v for k, v in extra.items() if k != "ds_ext"},
        "ds_ext": {"topology": TOPOLOGY, "samo": {"enabled": True}, **extra.get("ds_ext", {})},
    }
    if optimizer == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    else:
        opt = torch.optim.AdamW(model.parameters(), capturable=optimizer == "capturable")
    try:
        ds_ext.initialize(model=model, optimizer=opt, config=cfg)
    except Exception as err:  # noqa: BLE001 - the test inspects the type and message
        return type(err).__name__, str(err)
    return None


@pytest.mark.parametrize(
    "extra, optimizer, model_kind, message",
    [
        (
            {"zero_optimization": {"stage": 3}},
            "adamw",
            "mlp",
            "ds_ext.samo with zero_optimization.stage 3: SAMO shards the compressed optimizer state (stage 1) and the "
            "compressed gradients (stage 2) but keeps the dense 16-bit weights whole on every data-parallel rank; "
            "allowed: 0, 1, 2",
        ),
        (
            {"zero_optimization": {"stage": 2, "overlap_comm": True}},
            "adamw",
            "mlp",
            "ds_ext.samo with zero_optimization.overlap_comm True: SAMO's ZeRO-2 reduces each bucket of compressed "
            "gradients in the backward hook, on the compute stream; allowed: false",
        ),
        (
            {"zero_optimization": {"stage": 2, "reduce_scatter": False}},
            "adamw",
            "mlp",
            "ds_ext.samo with zero_optimization.reduce_scatter False: SAMO reduce-scatters the compressed gradients "
            "into the data-parallel shards; allowed: true (DeepSpeed's default)",
        ),
        (
            {"zero_optimization": {"stage": 2}},
            "adamw",
            "pipe",
            "ds_ext.samo with zero_optimization.stage 2: with a deepspeed.pipe.PipelineModule, ZeRO-2 and ZeRO-3 are "
            "incompatible with pipeline parallelism (DeepSpeed's PipelineEngine); allowed: 0, 1 with a PipelineModule",
        ),
        (
            {"ds_ext": {"tiled_optimizer": {"enabled": True}}},
            "capturable",
            "mlp",
            "ds_ext.tiled_optimizer: param group 0 sets capturable=True; the tiled step reproduces torch's "
            "single-tensor and fused Adam: allowed capturable=False, differentiable=False",
        ),
        *[
            (
                {"ds_ext": {name: {"enabled": True}, **tiled}},
                "adamw",
                "mlp",
                f"ds_ext.samo with ds_ext.{name}.enabled True: SAMO owns the gradient all-reduce and the optimizer "
                f"step and runs beside no other ds_ext plugin but ds_ext.tiled_optimizer; allowed: "
                f"ds_ext.{name}.enabled false",
            )
            for name in OTHER_PLUGINS
            for tiled in ({}, TILED)
        ],
        (
            {},
            "sgd",
            "mlp",
            "ds_ext.samo with optimizer 'SGD': SAMO's compressed step is run for Adam (001 §4.1.4); allowed: "
            "torch.optim.Adam, torch.optim.AdamW, deepspeed.ops.adam.FusedAdam",
        ),
        (
            {},
            "adamw",
            "linear",
            "ds_ext.samo.mask 'prune' found no pruning mask in the model; allowed: a model pruned with "
            "torch.nn.utils.prune ('prune'), weights with zeros ('zeros'), or a mask_file ('file')",
        ),
        (
            {},
            "adamw",
            "tied",
            "ds_ext.samo with deepspeed.pipe.TiedLayerSpec 't': DeepSpeed reduces the dense gradients of tied weights "
            "over their stages; allowed: a PipelineModule without tied layers",
        ),
    ],
    ids=[
        "zero3",
        "overlap_comm",
        "reduce_scatter",
        "zero2-pipe",
        "tiled-capturable",
        *[f"{name}{tiled}" for name in OTHER_PLUGINS for tiled in ("", "+tiled")],
        "sgd",
        "no-mask",
        "tied",
    ],
)
def test_unsupported_combinations_are_refused_in_one_line(worlds, extra, optimizer, model_kind, message):
    for res in worlds(2).run(_initialize_error, extra, optimizer, model_kind, timeout=120):
        assert res == ("DsExtConfigError", message)


def test_tensor_parallelism_and_moe_experts_are_refused_in_one_line():
    """What needs a caller's mpu or an expert model, checked on the functions initialize calls."""
    from ds_ext.errors import DsExtConfigError
    from ds_ext.samo import support

    with pytest.raises(DsExtConfigError) as err:
        support.check_layout(2, "the caller's mpu= argument")
    assert str(err.value) == (
        "ds_ext.samo with tensor parallel size (from the caller's mpu= argument) 2: the compressed step counts every "
        "parameter once over data and pipeline ranks only; allowed: tensor parallel 1 (data parallelism, a "
        "deepspeed.pipe.PipelineModule)"
    )
    model = mlp()
    model[0].fc.bias.allreduce = False  # DeepSpeed-MoE's mark of an expert parameter
    with pytest.raises(DsExtConfigError) as err:
        support.check_model(model)
    assert str(err.value) == (
        "ds_ext.samo with a deepspeed.moe expert parameter '0.fc.bias': expert parameters are reduced over their "
        "expert-data group, which SAMO does not do; allowed: dense models"
    )


def _resume(save_dir: str, split: int, steps: int) -> dict:
    """Train ``split`` steps, save a DeepSpeed checkpoint, load it into a fresh engine (new model
    and optimizer from the initial weights) and train to ``steps``; returns the weights."""
    import torch.distributed as dist

    import ds_ext
    from ds_ext.integration import ds_engine

    ds_engine.init_distributed()
    cfg = {
        "train_batch_size": MICRO * ACCUM * dist.get_world_size(),
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": CLIP,
        "steps_per_print": 10**9,
        "bf16": {"enabled": True},
        "ds_ext": {"topology": TOPOLOGY, "samo": {"enabled": True}},
    }
    engines = []
    for phase, (first, last) in enumerate(((0, split), (split, steps))):
        model = mlp()
        engine, *_ = ds_ext.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=LR), config=cfg)
        if phase:
            engine.load_checkpoint(save_dir)
        for step in range(first, last):
            for m in range(ACCUM):
                x, y = batch(step, dist.get_rank(), m)
                engine.backward(mse(engine(x.to(torch.bfloat16)), y))
                engine.step()
        if not phase:
            engine.save_checkpoint(save_dir)
        engines.append(engine)
    weights = {n: p.detach().clone() for n, p in engines[-1].module.named_parameters()}
    for engine in engines:
        engine.destroy()
    dist.barrier()
    return weights


def test_a_checkpoint_resumes_bit_for_bit(worlds, tmp_path):
    """bf16 on 2 ranks: 3 steps, save, load into a fresh engine, 3 more = 6 steps straight, bit for bit
    (the compressed masters and moments are in the checkpoint, not only the 16-bit weights)."""
    straight = worlds(2).run(_resume, str(tmp_path / "a"), 6, 6)
    resumed = worlds(2).run(_resume, str(tmp_path / "b"), 3, 6)
    for a, b in zip(straight, resumed):
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name], b[name]), name
