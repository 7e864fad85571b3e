"""Goldfish loss (000 §VIII-D, Hans et al. arXiv 2406.10209).

The mask equals a hand-written, loop-by-loop reading of the rule that shares no code with
``ds_ext.goldfish.mask``; with ``k = 10**9`` (nothing dropped) the loss and gradients equal the
standard ones bit for bit; the tokens dropped get exactly zero gradient through the loss (per
token, ds_ext's GPT / GPT-MoE and a Hugging Face model); through ``ds_ext.initialize`` on a gloo
world of 4 ranks the mask is the same on every rank, is evaluated once per micro-batch forward, and
the loss equals the reference masked mean; unsupported paths are refused before any collective.
"""

import pytest
import torch
from goldfish_reference import reference_keep as _reference_keep

WORLD_SIZE = 4
TOPOLOGY = {"preset": "frontier", "sizes": {"gcd": 1, "gpu": 2}, "emulate": True}


def _masked_mean_ce(logits: torch.Tensor, targets: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Reference loss: the mean of -log p(target) over the kept positions."""
    nll = -torch.log_softmax(logits.double(), -1).gather(-1, targets[..., None])[..., 0]
    return nll[keep].mean()


@pytest.mark.parametrize("k, h", [(2, 13), (4, 13), (3, 1), (2, 5), (7, 40)])
def test_mask_equals_the_hand_written_rule(k, h):
    from ds_ext.goldfish.mask import goldfish_keep

    g = torch.Generator().manual_seed(k * 100 + h)
    tokens = torch.randint(0, 50_000, (3, 257), generator=g)
    tokens[1, 100:140] = 0  # runs of one id, and the largest ids, hash like any other context
    tokens[2, 10:30] = 2**31 - 2
    ours = goldfish_keep(tokens, k, h)
    assert ours.dtype == torch.bool and ours.shape == tokens.shape
    for row, keep in zip(tokens.tolist(), ours.tolist()):
        assert keep == _reference_keep(row, k, h)
    assert goldfish_keep(tokens[:, : h // 2 + 1], k, h).all()  # shorter than the context: all kept


def test_mask_drops_one_in_k_and_is_deterministic_per_passage():
    from ds_ext.goldfish.mask import goldfish_keep

    tokens = torch.randint(0, 256, (8, 4096), generator=torch.Generator().manual_seed(0))
    for k in (2, 4, 13):
        dropped = 1 - goldfish_keep(tokens, k, 13)[:, 13:].double().mean().item()
        assert abs(dropped - 1 / k) < 0.01, (k, dropped)
    # the same passage at another offset, in another row: masked the same after its first h tokens
    passage = tokens[0, 1000:1300]
    moved = torch.cat([tokens[3, :77], passage])[None]
    assert torch.equal(goldfish_keep(moved, 2, 13)[0, 77 + 13 :], goldfish_keep(passage[None], 2, 13)[0, 13:])


def test_sequence_shards_read_the_true_preceding_tokens():
    from ds_ext.goldfish.mask import goldfish_keep

    tokens = torch.randint(0, 1000, (2, 600), generator=torch.Generator().manual_seed(1))
    whole = goldfish_keep(tokens, 2, 13)
    for start in (5, 13, 150, 599):
        shard = goldfish_keep(tokens[:, start:], 2, 13, preceding=tokens[:, :start])
        assert torch.equal(shard, whole[:, start:])
    assert torch.equal(goldfish_keep(tokens[:, 300:], 2, 13, preceding=tokens[:, 287:300]), whole[:, 300:])


def _gpt():
    from ds_ext.models import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, seq_len=48, d_model=32, n_layers=2, n_heads=2))


def _gpt_moe():
    from ds_ext.models.gpt_moe import GPTMoE, GPTMoEConfig

    torch.manual_seed(0)
    return GPTMoE(GPTMoEConfig(vocab_size=64, seq_len=48, d_model=32, n_layers=2, n_heads=2, num_experts=2))


@pytest.mark.parametrize("build", [_gpt, _gpt_moe])
def test_nothing_dropped_equals_the_standard_loss_bit_for_bit(build):
    from ds_ext.goldfish.mask import GoldfishMask

    tokens = torch.randint(0, 64, (4, 49), generator=torch.Generator().manual_seed(2))
    plain, gold = build(), build()
    gold.loss_mask = GoldfishMask(10**9, 13)
    assert gold.loss_mask(tokens).all()  # this k drops none of these tokens
    a, b = plain(tokens), gold(tokens)
    a.backward()
    b.backward()
    assert torch.equal(a, b)
    for p, q in zip(plain.parameters(), gold.parameters()):
        assert torch.equal(p.grad, q.grad)


@pytest.mark.parametrize("build", [_gpt, _gpt_moe])
def test_dropped_tokens_get_zero_gradient_and_the_mean_is_over_the_kept(build):
    from ds_ext.goldfish.mask import GoldfishMask

    model = build()
    model.loss_mask = GoldfishMask(2, 13)
    captured = {}
    logits_of = model.logits

    def keep_logits(tokens):
        out = logits_of(tokens)
        logits = out[0] if isinstance(out, tuple) else out  # GPT-MoE: (logits, l_aux)
        logits.retain_grad()
        captured["logits"], captured["aux"] = logits, out[1] if isinstance(out, tuple) else 0
        return out

    model.logits = keep_logits
    tokens = torch.randint(0, 64, (4, 49), generator=torch.Generator().manual_seed(3))
    loss = model(tokens)
    assert model.loss_mask.calls == 1
    keep = torch.tensor([_reference_keep(row, 2, 13) for row in tokens.tolist()])[:, 1:]
    assert (~keep).sum() > 20 and keep.sum() > 20
    ce = loss - getattr(model.cfg, "aux_loss_coef", 0) * captured["aux"]
    assert ce.item() == pytest.approx(
        _masked_mean_ce(captured["logits"].detach(), tokens[:, 1:], keep).item(), rel=1e-5
    )
    loss.backward()
    per_token = captured["logits"].grad.abs().sum(-1)
    assert torch.all(per_token[~keep] == 0)
    assert torch.all(per_token[keep] > 0)


def test_hugging_face_labels_dropped_get_zero_gradient():
    from ds_ext.goldfish.plugin import GoldfishPlugin
    from ds_ext.models.hf import tiny_causal_lm

    torch.manual_seed(0)
    model = tiny_causal_lm("llama", layers=1, hidden=32, heads=4, seq=64)
    plugin = GoldfishPlugin(GoldfishPlugin.Config(enabled=True, k=2, h=13), runtime=None)
    plugin.prepare(model, None, {})
    x = torch.randint(0, 256, (3, 64), generator=torch.Generator().manual_seed(4))
    out = model(input_ids=x, labels=x)
    out.logits.retain_grad()
    assert plugin.mask.calls == 1
    keep = torch.tensor([_reference_keep(row, 2, 13) for row in x.tolist()])[:, 1:]  # label t+1 from logits t
    ref = _masked_mean_ce(out.logits.detach()[:, :-1], x[:, 1:], keep)
    assert out.loss.item() == pytest.approx(ref.item(), rel=1e-5)
    out.loss.backward()
    per_token = out.logits.grad[:, :-1].abs().sum(-1)
    assert torch.all(per_token[~keep] == 0) and torch.all(per_token[keep] > 0)
    assert model(input_ids=x).loss is None  # no labels: nothing to mask, no loss


def test_models_whose_loss_is_not_masked_are_refused():
    """A pipeline model other than ds_ext's, GPT-NeoX's and Megatron-DeepSpeed's and a masked LM,
    whose labels are not the next tokens, are refused in one line."""
    from deepspeed.pipe import PipelineModule
    from transformers import BertConfig, BertForMaskedLM

    from ds_ext.errors import DsExtConfigError
    from ds_ext.goldfish.plugin import GoldfishPlugin
    from ds_ext.models.hf import tiny_causal_lm

    plugin = GoldfishPlugin(GoldfishPlugin.Config(enabled=True), runtime=None)
    pipe = PipelineModule.__new__(PipelineModule)  # its constructor needs a process group; the class decides
    bert = BertForMaskedLM(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2))
    for model, name in [
        (pipe, "deepspeed.runtime.pipe.module.PipelineModule"),
        (bert, "transformers.models.bert.modeling_bert.BertForMaskedLM"),
    ]:
        with pytest.raises(
            DsExtConfigError, match=f"^ds_ext.goldfish: the loss of a {name} is not masked; allowed models: "
        ):
            plugin.check(model)
    plugin.check(tiny_causal_lm("gpt-neox", layers=1, hidden=32))


def _megatron_ltor(data, eod_token, reset_position_ids, reset_attention_mask, eod_mask_loss, skip_mask=False):
    """The call shape of Megatron-DeepSpeed's megatron.utils.get_ltor_masks_and_position_ids; its loss
    mask is 0 at the end-of-document token when asked, as the client's."""
    loss_mask = torch.ones(data.shape)
    if eod_mask_loss:
        loss_mask[data == eod_token] = 0.0
    return "attention", loss_mask, "positions"


def test_megatron_loss_mask_is_the_hand_written_rule_on_the_labels():
    """Megatron-DeepSpeed's batch functions build ``loss_mask`` from the tokens ``x_0 .. x_{L-1}``;
    its column j weighs the label ``x_{j+1}``. Rebound (ds_ext.goldfish.client_loss), the function
    returns the client's own mask (end-of-document zeros kept) times the hand-written rule on the whole
    sequence ``x_0 .. x_L`` at the labels, ``x_h`` included; once per call; restore puts it back."""
    import types

    from ds_ext.goldfish import client_loss
    from ds_ext.goldfish.mask import GoldfishMask
    from ds_ext.goldfish.plugin import NextTokensLossMask

    script = types.ModuleType("pretrain_gpt")
    script.get_ltor_masks_and_position_ids = _megatron_ltor
    mask = GoldfishMask(2, 13)
    restore = client_loss.rebind(script, "get_ltor_masks_and_position_ids", lambda fn: NextTokensLossMask(fn, mask))
    x = torch.randint(0, 50, (3, 65), generator=torch.Generator().manual_seed(0))
    tokens = x[:, :-1]
    att, loss_mask, pos = script.get_ltor_masks_and_position_ids(tokens, 7, False, False, True)
    keep = torch.tensor([_reference_keep(row, 2, 13)[1:] for row in x.tolist()])
    assert (att, pos) == ("attention", "positions") and mask.calls == 1
    assert torch.equal(loss_mask, (tokens != 7).float() * keep.float())
    assert 0.3 < 1 - keep.float().mean() < 0.7
    restore()
    assert script.get_ltor_masks_and_position_ids is _megatron_ltor
    script.get_ltor_masks_and_position_ids = later = NextTokensLossMask(_megatron_ltor, mask)
    restore()  # again (DeepSpeed's __del__ calls destroy() once more): what was bound since stays
    assert script.get_ltor_masks_and_position_ids is later


def test_client_loss_sites_are_refused_where_they_are_not_the_clients(monkeypatch):
    """The clients' models are recognised by class; a main script without pretrain_gpt.py's
    ``get_ltor_masks_and_position_ids``, a site another engine rebound already and GPT-NeoX's
    ``train_impl`` other than ``normal`` are refused in one line naming ``ds_ext.goldfish``."""
    import sys
    import types

    from ds_ext.errors import DsExtConfigError
    from ds_ext.goldfish import client_loss
    from ds_ext.goldfish.mask import GoldfishMask
    from ds_ext.goldfish.plugin import NextTokensLossMask

    def model(module, name, **attrs):
        return type(name, (), {"__module__": module, **attrs})()

    assert client_loss.client_model(model("megatron.model.gpt_model", "GPTModel")) == "Megatron-DeepSpeed"
    assert client_loss.client_model(model("megatron.model.gpt_model", "GPTModelPipe")) == "Megatron-DeepSpeed"
    neox = model("megatron.model.utils", "SequentialWrapper", parent_class_name="GPT2ModelPipe")
    assert client_loss.client_model(neox) == "GPT-NeoX"
    assert client_loss.client_model(model("megatron.model.utils", "SequentialWrapper")) is None
    assert client_loss.client_model(model("megatron.model.gpt2_model", "GPT2ModelPipe")) is None  # its loss_fn

    script = types.ModuleType("__main__")
    script.__file__ = "my_train.py"
    monkeypatch.setitem(sys.modules, "__main__", script)
    with pytest.raises(DsExtConfigError) as err:
        client_loss.loss_site("Megatron-DeepSpeed", "ds_ext.goldfish")
    assert str(err.value) == (
        "ds_ext.goldfish: Megatron-DeepSpeed's loss_mask is built by get_ltor_masks_and_position_ids(data, "
        "eod_token, reset_position_ids, reset_attention_mask, eod_mask_loss, ...), which the main script "
        "(my_train.py) does not have; allowed: pretrain_gpt.py run as the main script"
    )
    script.get_ltor_masks_and_position_ids = _megatron_ltor
    assert client_loss.loss_site("Megatron-DeepSpeed", "ds_ext.goldfish") == (script, "get_ltor_masks_and_position_ids")
    script.get_ltor_masks_and_position_ids = NextTokensLossMask(_megatron_ltor, GoldfishMask(2, 13))
    with pytest.raises(DsExtConfigError, match=r"^ds_ext.goldfish: the main script \(my_train.py\)'s "):
        client_loss.loss_site("Megatron-DeepSpeed", "ds_ext.goldfish")
    with pytest.raises(DsExtConfigError) as err:
        client_loss.loss_site("GPT-NeoX", "ds_ext.goldfish", types.SimpleNamespace(train_impl="dpo"))
    assert str(err.value) == (
        "ds_ext.goldfish: GPT-NeoX's train_impl 'dpo' computes its own loss, not cross_entropy over loss_mask; "
        "allowed: train_impl 'normal'"
    )


def test_config_errors_name_the_key():
    from ds_ext import config
    from ds_ext.errors import DsExtConfigError

    assert config.parse({"goldfish": {"enabled": True}}).goldfish.model_dump() == {"enabled": True, "k": 2, "h": 13}
    for block, message in [
        ({"k": 1}, "ds_ext.goldfish.k: Input should be greater than or equal to 2 (got 1)"),
        ({"h": 0}, "ds_ext.goldfish.h: Input should be greater than or equal to 1 (got 0)"),
        ({"width": 3}, "ds_ext.goldfish.width: unknown key; allowed keys: enabled, h, k"),
    ]:
        with pytest.raises(DsExtConfigError) as err:
            config.parse({"goldfish": {"enabled": True, **block}})
        assert str(err.value) == message


def _train(kind, goldfish, steps=2):
    """ds_ext.initialize on 4 ranks (data parallel), GA 2; returns per-rank losses, the reference
    losses at the first step, the mask's calls and its value on one shared token tensor."""
    import torch.distributed as dist

    import ds_ext
    from ds_ext.models.hf import tiny_causal_lm

    torch.manual_seed(5)
    model = tiny_causal_lm("llama", layers=1, hidden=32, heads=4, seq=64) if kind == "hf" else _gpt()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "zero_optimization": {"stage": 1},
        "steps_per_print": 10**9,
        "ds_ext": {"topology": TOPOLOGY, **({"goldfish": {"enabled": True, "k": 2, "h": 13}} if goldfish else {})},
    }
    engine, *_ = ds_ext.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3), config=cfg)
    rank = dist.get_rank()
    losses, refs = [], []
    for step in range(steps):
        for m in range(2):
            g = torch.Generator().manual_seed(1000 * step + 10 * rank + m)
            x = torch.randint(0, 64, (2, 49), generator=g)
            loss = engine(input_ids=x, labels=x).loss if kind == "hf" else engine(x)
            if step == 0:
                refs.append(_reference_loss(kind, initial, x, goldfish))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    shared = torch.randint(0, 64, (2, 200), generator=torch.Generator().manual_seed(9))
    out = {"losses": losses, "refs": refs}
    if goldfish:
        mask = engine.ds_ext.plugin("goldfish").mask
        out["calls"] = mask.calls
        keep = mask(shared).to(torch.uint8)
        gathered = [torch.empty_like(keep) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, keep)
        out["same_on_every_rank"] = all(torch.equal(t, gathered[0]) for t in gathered)
    engine.destroy()
    return out


def _reference_loss(kind, initial, x, goldfish):
    """The first micro-batch's loss from the initial weights, by the reference masked mean."""
    from ds_ext.models.hf import tiny_causal_lm

    model = tiny_causal_lm("llama", layers=1, hidden=32, heads=4, seq=64) if kind == "hf" else _gpt()
    model.load_state_dict(initial)
    with torch.no_grad():
        logits = model(input_ids=x[:, :-1]).logits if kind == "hf" else model.logits(x[:, :-1])
    keep = torch.tensor([_reference_keep(row, 2, 13) if goldfish else [True] * len(row) for row in x.tolist()])[:, 1:]
    return _masked_mean_ce(logits, x[:, 1:], keep).item()


@pytest.mark.parametrize("kind", ["gpt", "hf"])
def test_goldfish_through_initialize_is_rank_independent_and_applied_once(world, kind):
    gold = world.run(_train, kind, True)
    plain = world.run(_train, kind, False)
    for g, p in zip(gold, plain):
        assert g["calls"] == 4  # one per micro-batch forward (2 steps x GA 2)
        assert g["same_on_every_rank"]
        assert g["losses"][:2] == pytest.approx(g["refs"], rel=1e-5)
        assert p["losses"][:2] == pytest.approx(p["refs"], rel=1e-5)
        assert g["losses"][0] != p["losses"][0]


def _initialize_error(block, model_kind):
    from init_support import initialize_error

    model = torch.nn.Linear(4, 4) if model_kind == "linear" else _gpt()
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9, "ds_ext": {"topology": TOPOLOGY, **block}}
    return initialize_error(model, cfg)


@pytest.mark.parametrize(
    "block, model_kind, message",
    [
        (
            {"goldfish": {"enabled": True}},
            "linear",
            "ds_ext.goldfish: the loss of a torch.nn.modules.linear.Linear is not masked; allowed models: "
            "ds_ext.models.GPT, ds_ext.models.gpt_moe.GPTMoE, ds_ext.models.gpt_pipe.gpt_pipeline's PipelineModule, "
            "GPT-NeoX's GPT2ModelPipe (pipe_parallel_size >= 1) and plain model (pipe_parallel_size 0), "
            "Megatron-DeepSpeed's GPTModel and GPTModelPipe (pretrain_gpt.py), "
            "a Hugging Face causal LM (AutoModelForCausalLM's classes)",
        ),
    ],
)
def test_unsupported_paths_are_refused_before_training(world, block, model_kind, message):
    for res in world.run(_initialize_error, block, model_kind, timeout=120):
        assert res == ("DsExtConfigError", message)


def test_exact_match_needs_every_one_of_the_last_n_tokens():
    from ds_ext.goldfish.memorization import exact_match

    docs = torch.randint(1, 50, (4, 20), generator=torch.Generator().manual_seed(6))
    near = docs[2].clone()
    near[-1] = 0  # doc 2 is known but for its very last token
    known = [docs[0].tolist(), near.tolist(), docs[3].tolist()]
    calls = []

    def logits(tokens):
        """An oracle: the next token of the known document the tokens so far begin, else token 0."""
        calls.append(tokens.shape[1])
        out = torch.zeros(*tokens.shape, 50)
        for b, row in enumerate(tokens.tolist()):
            for t in range(len(row)):
                out[b, t, next((d[t + 1] for d in known if d[: t + 1] == row[: t + 1] and t + 1 < len(d)), 0)] = 1
        return out

    assert exact_match(logits, docs, 5, batch_size=3).tolist() == [True, False, False, True]
    assert calls == [15, 16, 17, 18, 19] * 2  # greedy: one token at a time, prompted with the first 15
    assert exact_match(logits, docs[1:3], 1).tolist() == [False, False]


def test_memorization_benchmark_writes_its_records(tmp_path):
    import argparse
    import json

    from ds_ext.bench import memorization

    p = argparse.ArgumentParser()
    memorization.add_arguments(p)
    args = p.parse_args(
        f"--out {tmp_path}/m.json --seeds 3 --passes-per-epoch 1 --docs 4 --warmup-steps 2 --batch 4 "
        "--d-model 32 --layers 1 --n 8".split()
    )
    memorization.run(args)
    payload = json.loads((tmp_path / "m.json").read_text())
    assert (tmp_path / "m.png").stat().st_size > 0
    assert payload["steps"] == 2 + (1 + 4 + 6)  # 44 injected documents / batch 4
    records = payload["records"]
    assert [(r["loss"], r["k"], r["h"], r["epochs"]) for r in records] == [
        (loss, k, h, e)
        for loss, k, h in [("standard", None, None), ("goldfish", 2, 13), ("goldfish", 4, 13)]
        for e in (0, 1, 4, 6)
    ]
    assert all(0 <= r["exact_match"] <= 1 and r["exact_match_per_seed"] == [r["exact_match"]] for r in records)
    assert [r["dropped_fraction"] for r in records[4::4]] == pytest.approx([0.5, 0.25], abs=0.05)


def _pmm_step(family, grid):
    """One forward / backward under 3D-PMM with Goldfish (k = 2, h = 4) against the serial model on
    the same tokens with the hand-written mask: the loss and every gradient shard."""
    import torch.nn.functional as F
    from pmm_helpers import FP32, MODELS, call, ds_config, engine_for, tokens

    from ds_ext.pmm import local_shards

    cfg = ds_config(grid)
    cfg["ds_ext"]["goldfish"] = {"enabled": True, "k": 2, "h": 4}
    engine = engine_for(family, cfg)
    x = tokens(0)
    loss, _ = call(engine, family, x)
    engine.backward(loss)
    serial = MODELS[family]()
    if family == "gpt":
        keep = torch.tensor([_reference_keep(row, 2, 4) for row in x.tolist()])[:, 1:]
        logits = serial.logits(x[:, :-1])
        ref = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].masked_fill(~keep, -100).reshape(-1))
    else:
        ids = x[:, :-1]
        keep = torch.tensor([_reference_keep(row, 2, 4) for row in ids.tolist()])
        ref = serial(input_ids=ids, labels=ids.masked_fill(~keep, -100)).loss
    ref.backward()
    grads = local_shards(engine.module, {n: p.grad for n, p in serial.named_parameters()})
    worst = max(
        ((p.grad - grads[n]).abs().max() / grads[n].abs().max().clamp_min(1e-12)).item()
        for n, p in engine.module.named_parameters()
    )
    out = {"loss": loss.item(), "ref": ref.item(), "dropped": int((~keep).sum()), "worst_grad": worst}
    out["rtol"] = FP32["rtol"]
    engine.destroy()
    return out


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_goldfish_under_3d_pmm_vocabulary_parallel_equals_the_serial_masked_loss(world, family):
    """X = 2 (the vocabulary split: the mask enters before the cross-rank reductions) x Y = 2."""
    for r in world.run(_pmm_step, family, (2, 2, 1, 1)):
        assert r["dropped"] > 20
        assert r["loss"] == pytest.approx(r["ref"], rel=r["rtol"])
        assert r["worst_grad"] < 1e-4


def _trainer(k, tmp):
    """The Hugging Face Trainer (TrainingArguments(deepspeed=...)) with ds_ext active, Goldfish at
    ``k`` (None: off): the logged losses and how often the mask ran."""
    import torch.distributed as dist
    from hf_support import ByteWindows
    from transformers import Trainer, TrainingArguments

    import ds_ext
    from ds_ext.models.hf import tiny_causal_lm

    cfg = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "zero_optimization": {"stage": 0},
        "steps_per_print": 10**9,
        "ds_ext": {"topology": TOPOLOGY, **({"goldfish": {"enabled": True, "k": k, "h": 13}} if k else {})},
    }
    torch.manual_seed(1234)
    args = TrainingArguments(
        output_dir=f"{tmp}/out{dist.get_rank()}",
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=3,
        deepspeed=cfg,
        use_cpu=True,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        learning_rate=3e-3,
        seed=1234,
        data_seed=1234,
    )
    ds_ext.patch_deepspeed()
    try:
        trainer = Trainer(
            model=tiny_causal_lm("llama", layers=1, hidden=32), args=args, train_dataset=ByteWindows(seq=64)
        )
        trainer.train()
    finally:
        ds_ext.unpatch_deepspeed()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    calls = trainer.model_wrapped.ds_ext.plugin("goldfish").mask.calls if k else None
    trainer.model_wrapped.destroy()
    return losses, calls


def test_hugging_face_trainer_runs_goldfish_from_the_ds_config(world, tmp_path):
    """No script change: TrainingArguments(deepspeed=cfg) with the goldfish block. k = 10**9 drops
    nothing: the Trainer's logged losses (4 decimals) equal the plain run's; k = 2 changes them; the mask runs
    once per micro-batch (3 steps x GA 2)."""
    plain = world.run(_trainer, None, str(tmp_path))
    none_dropped = world.run(_trainer, 10**9, str(tmp_path))
    gold = world.run(_trainer, 2, str(tmp_path))
    for (p, _), (n, n_calls), (g, g_calls) in zip(plain, none_dropped, gold):
        assert len(p) == 3 and n == p
        assert n_calls == g_calls == 6
        assert g != p


def test_committed_memorization_study_shows_000s_shape():
    """examples/results/memorization.json (what docs/benchmarks/memorization.md reads): records of
    each loss at epochs 0 / 1 / 4 / 6; the standard loss memorizes with the epochs, Goldfish at
    000's k = 2 stays within one document of the control."""
    import json
    from pathlib import Path

    d = json.loads((Path(__file__).parents[1] / "examples" / "results" / "memorization.json").read_text())
    one_document = 1 / d["docs"]
    table = {(r["loss"], r["k"], r["h"], r["epochs"]): r["exact_match"] for r in d["records"]}
    assert set(table) == {
        (loss, k, h, e)
        for loss, k, h in [("standard", None, None), ("goldfish", 2, 13), ("goldfish", 4, 13)]
        for e in (0, 1, 4, 6)
    }
    assert all(0 <= v <= 1 for v in table.values())
    standard = [table["standard", None, None, e] for e in (0, 1, 4, 6)]
    assert standard == sorted(standard) and standard[-1] >= standard[0] + 0.5
    for e in (1, 4, 6):
        assert table["goldfish", 2, 13, e] <= table["goldfish", 2, 13, 0] + one_document


def _pipeline(k):
    """ds_ext's pipeline GPT on DeepSpeed's PipelineEngine, PP 2 x DP 2, 2 micro-batches, Goldfish at
    ``k`` (None: off), h = 4: train_batch's loss (the mean over micro-batches and data ranks) and the
    same mean from the serial GPT on the same weights, the labels masked by the hand-written rule."""
    import torch.distributed as dist
    import torch.nn.functional as F

    import ds_ext
    from ds_ext.integration import ds_engine
    from ds_ext.models import GPT, GPTConfig
    from ds_ext.models.gpt_pipe import gpt_pipeline, load_gpt_weights

    ds_engine.init_distributed()
    cfg = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=2)
    torch.manual_seed(0)
    gpt = GPT(cfg)
    pipe = gpt_pipeline(cfg, num_stages=2)
    load_gpt_weights(pipe, gpt)
    block = {"topology": TOPOLOGY, **({"goldfish": {"enabled": True, "k": k, "h": 4}} if k else {})}
    ds = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**9, "ds_ext": block}
    engine, *_ = ds_ext.initialize(model=pipe, optimizer=torch.optim.SGD(pipe.parameters(), lr=0.1), config=ds)

    def batches(data_rank):
        for m in range(2):
            x = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(10 * data_rank + m))
            yield x[:, :-1], x[:, 1:]

    loss = float(engine.train_batch(iter(batches(engine.grid.get_data_parallel_rank()))))
    refs = []
    with torch.no_grad():
        for data_rank in range(2):
            for inputs, labels in batches(data_rank):
                rows = [_reference_keep(row, k, 4) if k else [True] * 16 for row in labels.tolist()]
                keep = torch.tensor(rows)
                logits = gpt.logits(inputs)
                refs.append(F.cross_entropy(logits.flatten(0, 1), labels.masked_fill(~keep, -100).reshape(-1)).item())
    calls = engine.module.loss_fn.mask.calls if k else None
    is_last = engine.is_last_stage()
    engine.destroy()
    return {"loss": loss, "ref": sum(refs) / len(refs), "calls": calls, "last": is_last, "rank": dist.get_rank()}


def test_goldfish_on_the_pipeline_engine_masks_the_last_stages_labels(world):
    """ds_ext's pipeline GPT: train_batch's loss = the serial masked mean on every rank; the mask
    runs on the last stage, once per micro-batch; without Goldfish the same reference holds."""
    plain = world.run(_pipeline, None)
    gold = world.run(_pipeline, 2)
    for p, g in zip(plain, gold):
        assert p["loss"] == pytest.approx(p["ref"], rel=1e-5)
        assert g["loss"] == pytest.approx(g["ref"], rel=1e-5)
        assert g["loss"] != pytest.approx(p["loss"], rel=1e-3)
        assert g["calls"] == (2 if g["last"] else 0)


@pytest.mark.gpu
def test_mask_has_the_same_bits_on_cuda():
    """The hash is exact int64 arithmetic: a CUDA device computes the CPU's mask, on its own device."""
    from ds_ext.goldfish.mask import goldfish_keep

    tokens = torch.randint(0, 2**31 - 1, (4, 4096), generator=torch.Generator().manual_seed(7))
    on_cuda = goldfish_keep(tokens.cuda(), 2, 13, preceding=tokens[:, :50].cuda())
    assert on_cuda.device.type == "cuda"
    assert torch.equal(on_cuda.cpu(), goldfish_keep(tokens, 2, 13, preceding=tokens[:, :50]))
