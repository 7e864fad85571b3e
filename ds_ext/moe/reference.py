"""Serial model <-> TED rank: which part of a serial (unsliced, all-experts) tensor a rank holds.

A serial model is the same module tree built with ``ep_size=1`` and never bound; a TED rank
holds, for expert rank e (k = E / G_expert local experts), the experts ``[e k, (e+1) k)``
renumbered from 0, each tensor-parallel parameter's chunk t along its ``partition_dim``
(001 §7.1, Megatron's slicing), and every other tensor whole. Used to load a serial
initialization or checkpoint into a TED model and to compare TED against a serial reference.
"""

from __future__ import annotations

import re
from typing import Mapping

import torch

_EXPERT_KEY = re.compile(r"^(.*deepspeed_experts\.)(\d+)(\..*)$")


def serial_name(name: str, expert_rank: int, num_local_experts: int) -> str:
    """The serial name of a TED rank's parameter ``name`` (local expert i -> global e k + i)."""
    m = _EXPERT_KEY.match(name)
    if m is None:
        return name
    return f"{m.group(1)}{expert_rank * num_local_experts + int(m.group(2))}{m.group(3)}"


def local_expert_state(
    state: Mapping[str, torch.Tensor], expert_rank: int, num_local_experts: int
) -> dict[str, torch.Tensor]:
    """A serial state dict cut to the experts of ``expert_rank`` (what a model built with
    ``ep_size = G_expert`` loads before ``ds_ext.initialize`` slices it for the tensor group)."""
    out = {}
    lo = expert_rank * num_local_experts
    for key, value in state.items():
        m = _EXPERT_KEY.match(key)
        if m is None:
            out[key] = value
        elif lo <= int(m.group(2)) < lo + num_local_experts:
            out[f"{m.group(1)}{int(m.group(2)) - lo}{m.group(3)}"] = value
    return out


def tensor_shard(serial: torch.Tensor, param: torch.Tensor, tensor_rank: int, tensor_size: int) -> torch.Tensor:
    """The chunk of ``serial`` a bound, possibly tensor-parallel ``param`` corresponds to."""
    if not getattr(param, "tensor_model_parallel", False):
        return serial
    dim = param.partition_dim
    chunk = serial.shape[dim] // tensor_size
    return serial.narrow(dim, tensor_rank * chunk, chunk)
