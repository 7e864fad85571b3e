"""Benchmarks behind ``ds-ext bench <name>``.

Each module exposes ``add_arguments(parser)`` and ``run(args) -> dict``; ``run`` writes
its records to ``args.out`` (JSON), prints a table and saves a PNG next to the JSON.
Variants are always measured side by side in the same invocation so that ratios, not
absolute times on a noisy machine, carry the claims.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

BENCHMARKS: tuple[str, ...] = (
    "zero",
    "tiled",
    "tiled_step",
    "quant",
    "ledger",
    "pmm",
    "ted",
    "pccl",
    "scale",
    "memorization",
    "samo",
    "checkpoint",
)


def median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def mean_over_world(values: list[float]) -> list[float]:
    """``values`` averaged element-wise over every rank of the default group (collective)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


def write_json(path: str | Path, payload: dict[str, Any]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, sort_keys=False) + "\n")
    return path


def megatron_tensor_parallel(net: Any, tensor: int) -> Any:
    """ds_ext's GPT ``net`` with its block linears replaced by megatron-core's column / row
    parallel layers at ``tensor``-parallel degree (``parallel_state`` initialized by the caller;
    embeddings and norms stay replicated, as Megatron's are over the tensor group)."""
    import torch
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.transformer_config import TransformerConfig
    from torch import nn

    class Unpack(nn.Module):
        def __init__(self, layer: nn.Module) -> None:
            super().__init__()
            self.layer = layer

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layer(x)[0]

    d, heads, f = net.cfg.d_model, net.cfg.n_heads, net.cfg.ffn_mult * net.cfg.d_model
    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=d,
        num_attention_heads=heads,
        use_cpu_initialization=True,
        tensor_model_parallel_size=tensor,
    )
    init = nn.init.xavier_normal_

    def column(n_in: int, n_out: int) -> nn.Module:
        return Unpack(ColumnParallelLinear(n_in, n_out, config=cfg, init_method=init, bias=True, gather_output=False))

    def row(n_in: int, n_out: int) -> nn.Module:
        return Unpack(
            RowParallelLinear(
                n_in, n_out, config=cfg, init_method=init, bias=True, input_is_parallel=True, skip_bias_add=False
            )
        )

    for block in net.blocks:
        block.qkv, block.fc1 = column(d, 3 * d), column(d, f)
        block.proj, block.fc2 = row(d, d), row(f, d)
        block.n_heads = heads // tensor
    return net
