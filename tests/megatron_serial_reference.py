"""Megatron-DeepSpeed's ``pretrain_gpt.py`` on one rank with its MoE layers computed by the
independent reference (tests/moe_reference.py): the serial side of the acceptance test
tests/test_megatron_deepspeed_ted.py.

Usage (one rank, the client's directory as working directory, plain DeepSpeed, no ds_ext)::

    torchrun --standalone --nproc_per_node 1 tests/megatron_serial_reference.py pretrain_gpt.py ARGS...

``deepspeed.moe.layer.MoE`` is replaced, before Megatron imports it, by :class:`ReferenceMoE`:
all experts whole on this rank (``num_experts`` deep copies of the client's expert, as
DeepSpeed's ``Experts`` copies it), the gate ``Linear(H, E, bias=False)`` created after them
(DeepSpeed's order, so the same initial weights), and GShard's dense dispatch / combine from
tests/moe_reference.py. An expert returning ``(output, bias)`` (Megatron's ``ParallelMLP``)
contributes its output only, as DeepSpeed's ``Experts.forward`` does. With data parallelism D
the distributed run's rank d routes micro-batch d of each global batch; here micro-batch
``f mod D`` of forward f plays that shard: random token selection draws from the documented
seed of TED's gates (ds_ext/moe/gate.py, layer.py): seed + 1,000,003 x layer + 7,919 x shard,
forward n of a gate seeded s from ``moe_reference.generator(s, n)``.

Attention at tensor-parallel T reads its shard of ``query_key_value`` (contiguous rows of the
whole weight, ``--use-cpu-initialization``) as [q | k | v] thirds (megatron/model/transformer.py,
``ParallelAttention.forward``: ``each_hidden_size = mixed_x_layer.shape[-1] // 3``), so the client
computes a different function of the same whole weight at T = 2 than at T = 1. With
``REFERENCE_TENSOR_PARALLEL`` = T the serial model's rows are laid out as the T-rank run reads them
(q of every shard, then k, then v): the same function and, Adam being elementwise, the same
trajectory. Checked on the dense model (``--num-experts 1``): serial == TP 2 to 7 digits.

With ``REFERENCE_INIT`` = a directory written by tests/megatron_dump_init.py the serial model
starts from the distributed run's initial weights instead (whole experts, which the client cannot
initialize on its CPU path at tensor-parallel 2): tensor-parallel shards of data rank 0
concatenated along their split dimension (qkv rows laid out as above), expert e from the rank of
expert rank e // k, tensor rank 0, as local expert e mod k, everything else from rank 0.
"""

from __future__ import annotations

import copy
import os
import runpy
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import moe_reference as ref  # noqa: E402

TED_SEED, LAYER_STRIDE, SHARD_STRIDE = 1234, 1_000_003, 7_919
SHARDS = int(os.environ["REFERENCE_DATA_SHARDS"])  # D of the distributed run = micro-batches per step here
TENSOR = int(os.environ.get("REFERENCE_TENSOR_PARALLEL", "1"))  # T of the distributed run


def qkv_as_tensor_parallel(rows: torch.Tensor, tensor: int) -> torch.Tensor:
    """Rows [T shards x (q, k, v) thirds] of the whole weight reordered to [(q, k, v) x T shards]."""
    return rows.reshape(tensor, 3, -1, *rows.shape[1:]).transpose(0, 1).reshape(rows.shape)


def relayout_attention(attention_cls: type) -> None:
    """Wrap ``ParallelAttention.__init__`` so its whole qkv weight and bias read as at T ranks."""
    init = attention_cls.__init__

    def wrapped(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        with torch.no_grad():
            for p in self.query_key_value.parameters():
                p.copy_(qkv_as_tensor_parallel(p, TENSOR))

    attention_cls.__init__ = wrapped


def load_distributed_init(model: nn.Module, directory: Path) -> None:
    """Copy the weights tests/megatron_dump_init.py wrote into the serial ``model`` (docstring)."""
    dumps = [torch.load(f, weights_only=True) for f in sorted(directory.glob("rank*.pt"))]
    first = [d for d in dumps if d["data_rank"] == 0 and d["expert_rank"] == 0]
    shards = sorted(first, key=lambda d: d["tensor_rank"])
    experts = {d["expert_rank"]: d for d in dumps if d["tensor_rank"] == 0}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".mlp.experts." in name or name.endswith(".mlp.wg.weight"):
                prefix, _, rest = name.partition(".mlp.")
                if rest == "wg.weight":
                    p.copy_(shards[0]["params"][f"{prefix}.mlp.deepspeed_moe.gate.wg.weight"])
                    continue
                e, _, leaf = rest.removeprefix("experts.").partition(".")
                local = f"{prefix}.mlp.deepspeed_moe.experts.deepspeed_experts."
                k = len({n[len(local) :].split(".")[0] for n in experts[0]["params"] if n.startswith(local)})
                p.copy_(experts[int(e) // k]["params"][f"{local}{int(e) % k}.{leaf}"])
                continue
            dim = shards[0]["split"][name]
            whole = torch.cat([d["params"][name] for d in shards], dim) if dim >= 0 else shards[0]["params"][name]
            p.copy_(qkv_as_tensor_parallel(whole, TENSOR) if ".query_key_value." in name else whole)


class ReferenceMoE(nn.Module):
    """``deepspeed.moe.layer.MoE``'s constructor and return, computed by tests/moe_reference.py."""

    built = 0

    def __init__(
        self,
        hidden_size: int,
        expert: nn.Module,
        num_experts: int = 1,
        ep_size: int = 1,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 4,
        use_residual: bool = False,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        use_tutel: bool = False,
        enable_expert_tensor_parallelism: bool = False,
        top2_2nd_expert_sampling: bool = True,
        **_,
    ) -> None:
        super().__init__()
        assert not use_residual and not use_tutel
        self.experts = nn.ModuleList(copy.deepcopy(expert) for _ in range(num_experts))
        self.wg = nn.Linear(hidden_size, num_experts, bias=False).float()
        self.spec = ref.GateSpec(
            num_experts,
            k,
            capacity_factor,
            min_capacity,
            noisy_gate_policy,
            drop_tokens,
            use_rts,
            top2_2nd_expert_sampling,
        )
        self.layer = ReferenceMoE.built
        ReferenceMoE.built += 1
        self.forwards = 0

    def _expert(self, e: int):
        def run(x: torch.Tensor) -> torch.Tensor:
            out = self.experts[e](x.unsqueeze(1))  # Megatron's linear layers take [s, b, h]
            return (out[0] if isinstance(out, tuple) else out).squeeze(1)

        return run

    def forward(self, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None):
        shard, n = self.forwards % SHARDS, self.forwards // SHARDS
        self.forwards += 1
        gen = ref.generator(TED_SEED + LAYER_STRIDE * self.layer + SHARD_STRIDE * shard, n)
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        experts = [self._expert(e) for e in range(len(self.experts))]
        out, routing = ref.moe(x, self.wg.weight, experts, self.spec, gen, training=self.training)
        return out.reshape(hidden_states.shape), routing.l_aux, routing.exp_counts


if __name__ == "__main__":
    import deepspeed
    import deepspeed.moe.layer
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # unused on CPU, a 1-min JIT build otherwise
    deepspeed.moe.layer.MoE = ReferenceMoE
    if os.environ.get("REFERENCE_INIT"):
        import functools

        initialize = deepspeed.initialize

        @functools.wraps(initialize)
        def initialize_from_dump(*args, **kwargs):
            load_distributed_init(kwargs["model"], Path(os.environ["REFERENCE_INIT"]))
            return initialize(*args, **kwargs)

        deepspeed.initialize = initialize_from_dump
    elif TENSOR > 1:
        sys.path.insert(0, os.getcwd())
        import megatron.model.transformer

        relayout_attention(megatron.model.transformer.ParallelAttention)
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path.insert(0, str(Path(script).resolve().parent))
    runpy.run_path(script, run_name="__main__")
