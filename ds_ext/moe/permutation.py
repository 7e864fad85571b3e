"""The token dispatcher's local permutation: tokens into expert slots and the weighted combine
back (GShard's encode / decode; :mod:`ds_ext.moe.dispatcher` moves the slots between ranks).

Sharding contract: tokens ``[S, H]`` replicated over the tensor group; the dispatched
buffer ``[E, C, H]`` holds for global expert e (dim 0, expert-major: expert rank j owns
experts ``[j E/P, (j+1) E/P)``) its C capacity slots; slots no token fills are zero.
:func:`encode` gathers tokens into slots (one index_select), :func:`decode` gathers each
route's slot back and sums the routes weighted by their fp32 gates.
"""

from __future__ import annotations

import torch

from ds_ext.moe.gate import Decision


def slots(decision: Decision, num_experts: int) -> torch.Tensor:
    """Flat slot ``e * C + c`` of every route ``[k, S]``; dropped routes point at the scratch
    slot ``E * C`` (a zero row)."""
    C = decision.capacity
    flat = decision.indices * C + decision.locations
    return torch.where(decision.indices >= 0, flat, num_experts * C)


def encode(x: torch.Tensor, route_slots: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """``[S, H]`` tokens -> ``[E, C, H]`` expert slots."""
    S, H = x.shape
    source = torch.full((num_experts * capacity + 1,), S, dtype=torch.long, device=x.device)
    tokens = torch.arange(S, device=x.device).expand_as(route_slots)
    source.scatter_(0, route_slots.reshape(-1), tokens.reshape(-1))
    padded = torch.cat([x, x.new_zeros(1, H)])
    return padded.index_select(0, source[:-1]).view(num_experts, capacity, H)


def decode(y: torch.Tensor, route_slots: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
    """``[E, C, H]`` expert outputs -> ``[S, H]``: sum over routes of gate x output."""
    H = y.shape[-1]
    padded = torch.cat([y.reshape(-1, H), y.new_zeros(1, H)])
    routed = padded.index_select(0, route_slots.reshape(-1)).view(*route_slots.shape, H)
    return (routed * gates.unsqueeze(-1)).sum(0).to(y.dtype)
