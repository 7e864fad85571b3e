"""Shared by the 3D-PMM test modules: tiny models, data, the serial reference, engines.

Functions here run on the ranks of a ``world`` (tests/conftest.py). Every rank also trains the serial model on the whole global batch under the same seed
(weights of the parallel model are slices of the serial initialization) and compares,
at every step: the loss, every parameter's gradient after the data-parallel reduction
(sliced from the serial gradient), the global gradient norm, and after the last step
every parameter. Gradient clipping is off unless a test says otherwise.
"""

import pytest

WORLD_SIZE = 8
TOPOLOGY = {"preset": "frontier", "sizes": {"gpu": 2}, "emulate": True}
GLOBAL_BATCH, SEQ, STEPS, LR = 8, 16, 5, 1e-3
ADAM_EPS = 1e-6  # > the rounding noise of near-zero gradients, which Adam would amplify to O(lr)
GPT_GRIDS = [
    (2, 2, 2, 1),
    (2, 1, 2, 2),
    (1, 2, 2, 2),
    (4, 2, 1, 1),
    (2, 2, 1, 2),
    (8, 1, 1, 1),
    (1, 1, 8, 1),
    (1, 1, 1, 8),
]
# fp32: atol relative to the tensor's largest magnitude; a wrong layout is off by O(1) of it.
# Step 0 compares one forward/backward; later steps carry the drift of earlier Adam steps.
FP32 = {"rtol": 1e-4, "atol": 1e-5}
FP32_DRIFT = {"rtol": 1e-4, "atol": 1e-4}
BF16 = {"rtol": 2e-2, "atol": 5e-2}  # bf16 run vs the fp32 serial model: ~10 bf16 ulps of the scale


# ---- models and data (built identically on every rank) --------------------------------
def gpt(checkpoint=False, heads=8):
    import torch

    from ds_ext.models import GPT, GPTConfig

    torch.manual_seed(1234)
    return GPT(GPTConfig(seq_len=SEQ, d_model=64, n_layers=2, n_heads=heads, checkpoint=checkpoint))


def _neox(tied=False):
    import torch
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(1234)
    cfg = GPTNeoXConfig(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=SEQ,
        tie_word_embeddings=tied,
    )
    return GPTNeoXForCausalLM(cfg)


def _llama(tied=False):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1234)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=SEQ,
        tie_word_embeddings=tied,
    )
    return LlamaForCausalLM(cfg)


def _on_meta(family):
    """``family`` built by ds_ext.pmm.build_on_meta: parameters on the meta device, init recorded."""
    from ds_ext.pmm import build_on_meta

    return build_on_meta(MODELS[family])


MODELS = {
    "gpt": gpt,
    "gpt_ckpt": lambda: gpt(checkpoint=True),
    "gpt_4heads": lambda: gpt(heads=4),
    "neox": _neox,
    "llama": _llama,
    "neox_tied": lambda: _neox(tied=True),
    "llama_tied": lambda: _llama(tied=True),
}
MODELS.update({f"{f}_meta": (lambda f=f: _on_meta(f)) for f in ("gpt", "llama_tied")})  # serial run: the family itself


def tokens(step):
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, 256, (GLOBAL_BATCH, SEQ + 1), generator=g)


def call(model, family, tokens):
    """(loss, logits or None) of ``model`` on ``tokens``."""
    if family.startswith("gpt"):
        return model(tokens), None
    ids = tokens[:, :-1]
    out = model(input_ids=ids, labels=ids)
    return out.loss, out.logits


_SERIAL = {}


def serial_run(family, clip=0.0):
    """Per step: loss, full gradients, gradient norm, logits; then final parameters (cached)."""
    family = family.removesuffix("_meta")  # built on meta or not, the serial reference is the same
    key = (family, clip)
    if key not in _SERIAL:
        import torch

        model = MODELS[family]()
        opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=ADAM_EPS)
        steps = []
        for step in range(STEPS):
            loss, logits = call(model, family, tokens(step))
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip else float("inf"))
            steps.append(
                {
                    "loss": loss.item(),
                    "norm": float(norm),
                    "logits": logits,
                    "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
                }
            )
            opt.step()
            opt.zero_grad()
        _SERIAL[key] = (steps, {n: p.detach().clone() for n, p in model.named_parameters()})
    return _SERIAL[key]


def ds_config(
    grid, stage=0, bf16=False, clip=0.0, overlap=None, tiled=False, tune=False, by_layer=False, accum=1, tables=None
):
    x, y, z, data = grid
    pmm = {
        "enabled": True,
        "grid": {"x": x, "y": y, "z": z, "data": data},
        "ledger_by_layer": by_layer,
        "tune_matmul": tune,
        "overlap": overlap or {},
        **({"tables": tables} if tables else {}),
    }
    cfg = {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // (data * accum),
        "gradient_accumulation_steps": accum,
        "gradient_clipping": clip,
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
        "ds_ext": {"topology": TOPOLOGY, "pmm3d": pmm},
    }
    if bf16:
        cfg["bf16"] = {"enabled": True}
    if tiled:
        cfg["ds_ext"]["tiled_optimizer"] = {"enabled": True, "tile_size": 1000}
    return cfg


def engine_for(family, cfg):
    import torch

    import ds_ext

    engine, *_ = ds_ext.initialize(
        model=MODELS[family](), optimizer=lambda p: torch.optim.AdamW(p, lr=LR, eps=ADAM_EPS), config=cfg
    )
    return engine


def _rows(engine):
    """This rank's rows of the global batch: its data group's share, then its Z share."""
    axes = engine.ds_ext.plugin("pmm3d").axes
    micro = GLOBAL_BATCH // axes["data"].size
    share = micro // axes["z"].size
    start = axes["data"].rank * micro
    return slice(start, start + micro), slice(start + axes["z"].rank * share, start + (axes["z"].rank + 1) * share)


def train_and_compare(family, grid, clip=0.0, check=True, stage=0, no_grad_first=False, **cfg_kw):
    """Train STEPS steps; with ``check``, assert parity with the serial run at every step;
    ``no_grad_first``: one evaluation forward (autograd off) before the first step.

    Stage 0 keeps reduced gradients in ``p.grad``: each is compared, and the norm is
    :func:`ds_ext.pmm.norm.global_grad_norm`. ZeRO-1/2 moves them into DeepSpeed's
    partitions, so there the norm DeepSpeed computed (``get_global_grad_norm``) is compared.
    """
    from ds_ext.pmm import local_shards
    from ds_ext.pmm.norm import global_grad_norm

    engine = engine_for(family, ds_config(grid, clip=clip, stage=stage, **cfg_kw))
    plugin = engine.ds_ext.plugin("pmm3d")
    model = engine.module
    data_rows, z_rows = _rows(engine)
    steps, final = serial_run(family, clip)
    out = {"losses": [], "norms": []}
    if no_grad_first:
        import torch

        with torch.no_grad():
            call(engine, family, tokens(0)[data_rows])
    for step in range(STEPS):
        loss, logits = call(engine, family, tokens(step)[data_rows])
        engine.backward(loss)
        ref = steps[step]
        tol = BF16 if cfg_kw.get("bf16") else FP32 if step == 0 else FP32_DRIFT
        mean_loss = _data_mean(loss.detach().float(), plugin.axes["data"])
        out["losses"].append(mean_loss)
        if check:
            assert mean_loss == pytest.approx(ref["loss"], rel=tol["rtol"]), (step, mean_loss, ref["loss"])
            if logits is not None:  # this rank's rows and vocabulary block (split over X, or all of it)
                block = logits.shape[-1]
                coord = plugin.axes["x"].rank if block < ref["logits"].shape[-1] else 0
                vocab = slice(coord * block, (coord + 1) * block)
                _close(logits, ref["logits"][z_rows][..., vocab], tol, f"step {step} logits")
        if stage == 0:
            out["norms"].append(global_grad_norm(model, plugin.axes, engine.ds_ext.comm))
            if check:
                shards = local_shards(model, ref["grads"])
                assert set(shards) == {n for n, _ in model.named_parameters()}
                for name, p in model.named_parameters():
                    _close(p.grad, shards[name], tol, f"step {step} grad {name}")
        engine.step()
        if stage > 0:
            out["norms"].append(float(engine.get_global_grad_norm()))
        if check:
            assert out["norms"][-1] == pytest.approx(ref["norm"], rel=tol["rtol"]), (
                step,
                out["norms"][-1],
                ref["norm"],
            )
    if check:
        # bf16: Adam turns gradients that are pure rounding noise (e.g. the key bias, whose exact
        # gradient is 0) into steps of up to LR, so parameters may differ by 2 STEPS LR more
        slack = 2 * STEPS * LR if cfg_kw.get("bf16") else 0.0
        for name, want in local_shards(model, final).items():
            _close(dict(model.named_parameters())[name].detach(), want, tol, f"final {name}", slack)
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    eng = plugin.engine
    out["telemetry"] = {
        "prefetch_hits": eng.prefetcher.hits if eng.prefetcher else 0,
        "recorded_order": [layer.name for layer in eng.prefetcher.order] if eng.prefetcher else [],
        "deferred_waited": eng.deferred.waited if eng.deferred else 0,
        "tuned_sites": sorted(eng.tuner.site_choice) if eng.tuner else [],
        "tuned_modes": dict(eng.tuner.site_choice) if eng.tuner else {},
    }
    engine.destroy()
    return out


def _data_mean(loss, data_axis):
    """The global batch's loss: the mean of the data groups' losses."""
    import torch.distributed as dist

    loss = loss.clone()
    dist.all_reduce(loss, group=data_axis.group)
    return loss.item() / data_axis.size


def _close(got, want, tol, what, slack=0.0):
    """Elementwise within rtol, plus atol relative to the tensor's largest magnitude (+ slack)."""
    import torch

    scale = float(want.abs().max()) or 1.0
    torch.testing.assert_close(
        got.float(),
        want.float(),
        rtol=tol["rtol"],
        atol=tol["atol"] * scale + slack,
        msg=lambda m: f"{what} (max |ref| {scale:.3g}): {m}",
    )


def parity(family, grid, **kw):
    out = train_and_compare(family, grid, **kw)
    return out["losses"], out["norms"]
