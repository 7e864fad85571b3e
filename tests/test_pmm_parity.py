"""3D-PMM on 8 gloo ranks (2 nodes x 2 GPUs x 2 GCDs, emulated) against the serial model.

Every rank also trains the serial model on the whole global batch under the same seed
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
GPT_GRIDS = [(2, 2, 2, 1), (2, 1, 2, 2), (1, 2, 2, 2), (4, 2, 1, 1), (2, 2, 1, 2), (8, 1, 1, 1), (1, 1, 8, 1),
             (1, 1, 1, 8)]
# fp32: atol relative to the tensor's largest magnitude; a wrong layout is off by O(1) of it.
# Step 0 compares one forward/backward; later steps carry the drift of earlier Adam steps.
FP32 = {"rtol": 1e-4, "atol": 1e-5}
FP32_DRIFT = {"rtol": 1e-4, "atol": 1e-4}
BF16 = {"rtol": 2e-2, "atol": 2e-2}


# ---- models and data (built identically on every rank) --------------------------------
def _gpt(checkpoint=False):
    import torch

    from ds_ext.models import GPT, GPTConfig

    torch.manual_seed(1234)
    return GPT(GPTConfig(seq_len=SEQ, d_model=64, n_layers=2, n_heads=8, checkpoint=checkpoint))


def _neox():
    import torch
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(1234)
    cfg = GPTNeoXConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=SEQ)
    return GPTNeoXForCausalLM(cfg)


def _llama():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1234)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=128, max_position_embeddings=SEQ)
    return LlamaForCausalLM(cfg)


MODELS = {"gpt": _gpt, "gpt_ckpt": lambda: _gpt(checkpoint=True), "neox": _neox, "llama": _llama}


def _tokens(step):
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, 256, (GLOBAL_BATCH, SEQ + 1), generator=g)


def _call(model, family, tokens):
    """(loss, logits or None) of ``model`` on ``tokens``."""
    if family.startswith("gpt"):
        return model(tokens), None
    ids = tokens[:, :-1]
    out = model(input_ids=ids, labels=ids)
    return out.loss, out.logits


_SERIAL = {}


def _serial(family, clip=0.0):
    """Per step: loss, full gradients, gradient norm, logits; then final parameters (cached)."""
    key = (family, clip)
    if key not in _SERIAL:
        import torch

        model = MODELS[family]()
        opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=ADAM_EPS)
        steps = []
        for step in range(STEPS):
            loss, logits = _call(model, family, _tokens(step))
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip else float("inf"))
            steps.append({"loss": loss.item(), "norm": float(norm), "logits": logits,
                          "grads": {n: p.grad.clone() for n, p in model.named_parameters()}})
            opt.step()
            opt.zero_grad()
        _SERIAL[key] = (steps, {n: p.detach().clone() for n, p in model.named_parameters()})
    return _SERIAL[key]


def _ds_config(grid, stage=0, bf16=False, clip=0.0, overlap=None, tiled=False, tune=False, by_layer=False):
    x, y, z, data = grid
    pmm = {"enabled": True, "grid": {"x": x, "y": y, "z": z, "data": data}, "ledger_by_layer": by_layer,
           "tune_matmul": tune, "overlap": overlap or {}}
    cfg = {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // data,
        "gradient_accumulation_steps": 1,
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


def _engine(family, cfg):
    import torch

    import ds_ext

    engine, *_ = ds_ext.initialize(model=MODELS[family](), optimizer=lambda p: torch.optim.AdamW(p, lr=LR, eps=ADAM_EPS),
                                   config=cfg)
    return engine


def _rows(engine):
    """This rank's rows of the global batch: its data group's share, then its Z share."""
    axes = engine.ds_ext.plugins[-1].axes
    micro = GLOBAL_BATCH // axes["data"].size
    share = micro // axes["z"].size
    start = axes["data"].rank * micro
    return slice(start, start + micro), slice(start + axes["z"].rank * share, start + (axes["z"].rank + 1) * share)


def _train_and_compare(family, grid, clip=0.0, check=True, **cfg_kw):
    """Train STEPS steps; with ``check``, assert parity with the serial run at every step."""
    import torch

    from ds_ext.pmm import local_shards
    from ds_ext.pmm.norm import global_grad_norm

    engine = _engine(family, _ds_config(grid, clip=clip, **cfg_kw))
    plugin = engine.ds_ext.plugins[-1]
    model = engine.module
    data_rows, z_rows = _rows(engine)
    steps, final = _serial(family, clip)
    out = {"losses": [], "norms": []}
    for step in range(STEPS):
        loss, logits = _call(engine, family, _tokens(step)[data_rows])
        engine.backward(loss)
        ref = steps[step]
        tol = BF16 if cfg_kw.get("bf16") else FP32 if step == 0 else FP32_DRIFT
        norm = global_grad_norm(model, plugin.axes, engine.ds_ext.comm)
        mean_loss = _data_mean(loss.detach().float(), plugin.axes["data"])
        out["losses"].append(mean_loss)
        out["norms"].append(norm)
        if check:
            assert mean_loss == pytest.approx(ref["loss"], rel=tol["rtol"]), (step, mean_loss, ref["loss"])
            assert norm == pytest.approx(ref["norm"], rel=tol["rtol"]), (step, norm, ref["norm"])
            if logits is not None:
                _close(logits, ref["logits"][z_rows], tol, f"step {step} logits")
            shards = local_shards(model, ref["grads"])
            assert set(shards) == {n for n, _ in model.named_parameters()}
            for name, p in model.named_parameters():
                grad = p.grad if p.grad is not None else engine.optimizer  # ZeRO keeps grads elsewhere
                if torch.is_tensor(grad):
                    _close(grad, shards[name], tol, f"step {step} grad {name}")
        engine.step()
    if check:
        for name, want in local_shards(model, final).items():
            _close(dict(model.named_parameters())[name].detach(), want, tol, f"final {name}")
    out["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    out["plugin"] = plugin
    engine.destroy()
    return out


def _data_mean(loss, data_axis):
    """The global batch's loss: the mean of the data groups' losses."""
    import torch.distributed as dist

    loss = loss.clone()
    dist.all_reduce(loss, group=data_axis.group)
    return loss.item() / data_axis.size


def _close(got, want, tol, what):
    """Elementwise within rtol, plus atol relative to the tensor's largest magnitude."""
    import torch

    scale = float(want.abs().max()) or 1.0
    torch.testing.assert_close(got.float(), want.float(), rtol=tol["rtol"], atol=tol["atol"] * scale,
                               msg=lambda m: f"{what} (max |ref| {scale:.3g}): {m}")


def _parity(family, grid, **kw):
    out = _train_and_compare(family, grid, **kw)
    return out["losses"], out["norms"]


@pytest.mark.parametrize("grid", GPT_GRIDS, ids=lambda g: "x{}y{}z{}d{}".format(*g))
def test_gpt_parity(world, grid):
    results = world.run(_parity, "gpt", grid)
    losses = results[0][0]
    assert all(r[0] == losses for r in results)  # every rank reports the whole model's loss


@pytest.mark.parametrize("family,grid", [("neox", (2, 2, 2, 1)), ("neox", (2, 1, 2, 2)),
                                         ("llama", (2, 2, 2, 1)), ("llama", (1, 2, 2, 2))])
def test_hf_parity(world, family, grid):
    world.run(_parity, family, grid)
