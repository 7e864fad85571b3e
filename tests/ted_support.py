"""Helpers shared by the TED test modules (run on the spawned ranks): a tiny GPT-MoE, its data
shards, the serial reference, and TED models built from the serial initialization.

The serial reference (:class:`SerialGPTMoE`, 001 §7.1) is plain torch: its own parameter
tensors under ``GPTMoE``'s state-dict names, its own forward, every MoE layer computed by
tests/moe_reference.py with all experts whole, gradients straight from autograd on those
tensors. It imports nothing from ds_ext.moe or ds_ext.models, so it shares no code (expert
copies, parameter marks, hooks) with the TED model it checks.
"""

from __future__ import annotations

import dataclasses

TOPOLOGY = {"preset": "frontier", "sizes": {"gpu": 2}, "emulate": True}  # 2 nodes x 2 GPUs x 2 GCDs
MICRO, SEQ = 2, 16
_CORPUS = []


def corpus():
    from ds_ext.data import ByteCorpus

    if not _CORPUS:
        _CORPUS.append(ByteCorpus(max_bytes=300_000))
    return _CORPUS[0]


def config(**kw):
    from ds_ext.models.gpt_moe import GPTMoEConfig

    base = dict(
        seq_len=SEQ,
        d_model=32,
        n_layers=2,
        n_heads=4,
        num_experts=4,
        min_capacity=0,
        use_rts=False,
        top2_2nd_expert_sampling=False,
    )
    return GPTMoEConfig(**{**base, **kw})


def shards(layout, step=0, micro=MICRO):
    """The global batch of ``step`` as one micro-batch per non-expert data rank."""
    return [corpus().micro_batch(step, 0, d, layout.nonexp_data, micro, 1, SEQ) for d in range(layout.nonexp_data)]


_EXPERTS = "ffn.deepspeed_moe.experts.deepspeed_experts"


def _is_moe(cfg, block):
    return block % cfg.moe_every == cfg.moe_every - 1  # every moe_every-th feed-forward (001 §7.1.1)


def serial_shapes(cfg):
    """{name: (shape, init)} of the serial GPT-MoE under ``GPTMoE``'s state-dict names; init
    ``normal`` (std 0.02, linear and embedding weights), ``zeros`` (biases), ``ones`` (norm gains)."""
    d, f, E = cfg.d_model, cfg.ffn_mult * cfg.d_model, cfg.num_experts
    out = {"embed.weight": ((cfg.vocab_size, d), "normal"), "pos.weight": ((cfg.seq_len, d), "normal")}

    def linear(name, n_in, n_out):
        out[f"{name}.weight"], out[f"{name}.bias"] = ((n_out, n_in), "normal"), ((n_out,), "zeros")

    def norm(name):
        out[f"{name}.weight"], out[f"{name}.bias"] = ((d,), "ones"), ((d,), "zeros")

    for b in range(cfg.n_layers):
        norm(f"blocks.{b}.ln1")
        linear(f"blocks.{b}.attn.qkv", d, 3 * d)
        linear(f"blocks.{b}.attn.proj", d, d)
        norm(f"blocks.{b}.ln2")
        if _is_moe(cfg, b):
            out[f"blocks.{b}.ffn.deepspeed_moe.gate.wg.weight"] = ((E, d), "normal")
            for e in range(E):
                linear(f"blocks.{b}.{_EXPERTS}.{e}.0", d, f)
                linear(f"blocks.{b}.{_EXPERTS}.{e}.2", f, d)
        else:
            linear(f"blocks.{b}.ffn.fc1", d, f)
            linear(f"blocks.{b}.ffn.fc2", f, d)
    norm("ln_f")
    return out


class SerialGPTMoE:
    """The serial reference of a ``GPTMoE`` config in plain torch (module docstring): pre-norm
    blocks, causal attention (QKV rows ordered (head, q/k/v, dim)), tied LM head, loss =
    cross-entropy + ``aux_loss_coef`` x sum of l_aux. MoE layer b's n-th forward draws from
    ``moe_reference.generator(b, n)``; ``exp_counts`` collects each MoE forward's routes per expert."""

    def __init__(self, cfg, seed=0):
        import torch

        gen = torch.Generator().manual_seed(seed)
        self.cfg = cfg
        self.params = {}
        for name, (shape, init) in serial_shapes(cfg).items():
            t = (
                0.02 * torch.randn(shape, generator=gen)
                if init == "normal"
                else (torch.ones(shape) if init == "ones" else torch.zeros(shape))
            )
            self.params[name] = t.requires_grad_()
        self.training = True
        self.forwards = {}  # MoE block -> forwards so far
        self.exp_counts = []

    def named_parameters(self):
        return iter(self.params.items())

    def parameters(self):
        return iter(self.params.values())

    def state_dict(self):
        return {n: p.detach().clone() for n, p in self.params.items()}

    def train(self, mode=True):
        self.training = mode
        return self

    def eval(self):
        return self.train(False)

    def _moe(self, b, x):
        import moe_reference as ref

        cfg, W = self.cfg, self.params
        spec = ref.GateSpec(
            num_experts=cfg.num_experts,
            k=cfg.top_k,
            capacity_factor=cfg.capacity_factor if self.training else cfg.eval_capacity_factor,
            min_capacity=cfg.min_capacity,
            noisy_gate_policy=cfg.noisy_gate_policy,
            drop_tokens=cfg.drop_tokens,
            use_rts=cfg.use_rts,
            top2_2nd_expert_sampling=cfg.top2_2nd_expert_sampling,
        )
        pre = f"blocks.{b}.{_EXPERTS}"
        experts = [
            ref.Expert(
                W[f"{pre}.{e}.0.weight"], W[f"{pre}.{e}.0.bias"], W[f"{pre}.{e}.2.weight"], W[f"{pre}.{e}.2.bias"]
            )
            for e in range(cfg.num_experts)
        ]
        n = self.forwards.get(b, 0)
        self.forwards[b] = n + 1
        out, routing = ref.moe(
            x,
            W[f"blocks.{b}.ffn.deepspeed_moe.gate.wg.weight"],
            experts,
            spec,
            ref.generator(b, n),
            training=self.training,
        )
        self.exp_counts.append(routing.exp_counts)
        return out, routing.l_aux

    def __call__(self, tokens):
        """``tokens`` ``[batch, seq_len + 1]`` -> the loss over positions 1..seq_len."""
        import torch.nn.functional as F

        cfg, W = self.cfg, self.params
        d, heads = cfg.d_model, cfg.n_heads
        inp, target = tokens[:, :-1], tokens[:, 1:]
        B, S = inp.shape

        def norm(name, x):
            return F.layer_norm(x, (d,), W[f"{name}.weight"], W[f"{name}.bias"])

        def linear(name, x):
            return x @ W[f"{name}.weight"].t() + W[f"{name}.bias"]

        x = W["embed.weight"][inp] + W["pos.weight"][:S]
        l_aux = x.new_zeros(())
        for b in range(cfg.n_layers):
            q, k, v = (
                linear(f"blocks.{b}.attn.qkv", norm(f"blocks.{b}.ln1", x))
                .view(B, S, heads, 3, d // heads)
                .permute(3, 0, 2, 1, 4)
            )
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + linear(f"blocks.{b}.attn.proj", a.transpose(1, 2).reshape(B, S, d))
            h = norm(f"blocks.{b}.ln2", x)
            if _is_moe(cfg, b):
                y, aux = self._moe(b, h.reshape(-1, d))
                x, l_aux = x + y.view(B, S, d), l_aux + aux
            else:
                x = x + linear(f"blocks.{b}.ffn.fc2", F.gelu(linear(f"blocks.{b}.ffn.fc1", h)))
        logits = norm("ln_f", x) @ W["embed.weight"].t()
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))
        return ce + cfg.aux_loss_coef * l_aux


def serial_model(cfg, seed=0):
    """The serial reference of ``cfg`` (:class:`SerialGPTMoE`), its weights drawn from ``seed``."""
    return SerialGPTMoE(cfg, seed)


def serial_loss(model, batches):
    """The data-parallel objective: every shard through the whole model, losses averaged."""
    import torch

    losses = [model(b) for b in batches]
    return torch.stack(losses).mean(), [x.item() for x in losses]


def serial(cfg, batches, seed=0):
    model = serial_model(cfg, seed)
    loss, losses = serial_loss(model, batches)
    loss.backward()
    return model, losses, {n: p.grad for n, p in model.named_parameters()}


def ted_model(cfg, serial_state, layout, rank):
    """The serial initialization, built for this rank's expert rank (``ep_size = G_expert``)."""
    from ds_ext.models.gpt_moe import GPTMoE
    from ds_ext.moe.reference import local_expert_state

    model = GPTMoE(dataclasses.replace(cfg, ep_size=layout.expert))
    k = cfg.num_experts // layout.expert
    model.load_state_dict(local_expert_state(serial_state, layout.coords(rank)["expert"], k))
    return model


def bind(model, ted):
    """Bind a model's TED layers to a context by hand (what the ted plugin does)."""
    for i, m in enumerate(m for m in model.modules() if hasattr(m, "ted_bind")):
        m.ted_bind(ted, i)
    return model


def context(T, P, **kw):
    """A runtime on the emulated topology and a TED context of (T, P)."""
    import torch.distributed as dist

    from ds_ext import config as cfgmod
    from ds_ext.moe import TEDContext
    from ds_ext.parallel import TEDLayout
    from ds_ext.runtime import Runtime

    runtime = Runtime.create(cfgmod.parse({"topology": TOPOLOGY}))
    return runtime, TEDContext.create(TEDLayout.build(dist.get_world_size(), T, P), runtime.comm, **kw)


def serial_view(model, serial_tensors, layout, rank):
    """{name: the part of the serial tensor this rank's parameter ``name`` holds}: local expert i
    of expert rank e is serial expert e k + i; a parameter whose shape differs from the serial
    one in a dimension holds chunk t (the tensor rank) of it."""
    import re

    c = layout.coords(rank)
    k = next(m.num_local_experts for m in model.modules() if hasattr(m, "num_local_experts"))
    out = {}
    for name, p in model.named_parameters():
        serial = serial_tensors[
            re.sub(r"(deepspeed_experts\.)(\d+)", lambda m: f"{m.group(1)}{c['expert'] * k + int(m.group(2))}", name)
        ]
        split = [i for i, (a, b) in enumerate(zip(p.shape, serial.shape, strict=True)) if a != b]
        if split:
            (dim,) = split
            assert p.shape[dim] * layout.tensor == serial.shape[dim], (name, p.shape, serial.shape)
            serial = serial.narrow(dim, c["tensor"] * p.shape[dim], p.shape[dim])
        out[name] = serial
    return out


def assert_close_to_serial(named, views, rtol=1e-5):
    """Every tensor within rtol of its serial view (atol rtol x the view's max); returns the count."""
    import torch

    for name, t in named.items():
        ref = views[name]
        torch.testing.assert_close(t, ref, rtol=rtol, atol=rtol * ref.abs().max().item(), msg=name)
    return len(named)


def ds_config(T, P, stage=0, ted=None, plugins=None, **extra):
    """A ds_config with ``ds_ext.ted`` (T, P) (+ ``ted`` keys), other ``plugins`` sections and
    top-level DeepSpeed keys ``extra`` (``gradient_clipping`` 0 unless given: DeepSpeed's default is 1.0)."""
    block = {
        "topology": TOPOLOGY,
        "ted": {"enabled": True, "tensor_parallel": T, "expert_parallel": P, **(ted or {})},
        **(plugins or {}),
    }
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**6,
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 0.0,
        "ds_ext": block,
        **extra,
    }


def average_gradients(model, ted):
    """DeepSpeed's data-parallel averaging done by hand: non-expert gradients summed over
    G_data^nonexp, expert gradients over G_data^exp, both divided by G_data^nonexp."""
    import torch.distributed as dist

    for p in model.parameters():
        expert = getattr(p, "allreduce", True) is False
        dist.all_reduce(p.grad, group=ted.groups["expert_data" if expert else "data"])
        p.grad /= ted.layout.nonexp_data
