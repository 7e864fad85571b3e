"""An independent reference gate and MoE layer, written from the GShard (Lepikhin et al. 2020,
Algorithm 1: dense ``combine_weights [S, E, C]``, ``dispatch = combine != 0``, einsum dispatch and
combine) and DeepSpeed-MoE (``sharded_moe.py``: top1gating / top2gating / topkgating) formulas.

It imports nothing from ``ds_ext``: it is the other side of the parity tests of ``ds_ext.moe``
(tests/test_ted_reference.py, tests/test_ted_gate.py), and DeepSpeed's own gate functions check it
in turn. Everything runs on one process: a layer whose experts live on many ranks is evaluated
here with all experts whole, one data shard at a time.

Notation: S tokens, E experts, H hidden, C capacity, k routes per token, f capacity factor.

* capacity (drop): C = max(ceil(fp32(S / E) x fp32(f k)), min_capacity) (DeepSpeed's dtype);
  dropless: the largest number of routes any expert received. A layer spread over an expert
  group uses one C for the group: ``agree`` maps this shard's C to the group's (the caller
  computes the maximum over the shards of the group);
* l_aux: k = 1: E sum_e me_e ce_e; k = 2: E^2 mean_e(me_e ce_e); k >= 3: E^2 / k mean_e(...),
  me = mean over tokens of the softmax gates, ce = fraction of tokens whose first choice
  (k >= 3: any of the k choices) is e;
* random draws of one forward, in this order, from the generator the caller hands in:
  jitter u [S, H] (x times 1 + 1e-2 (2u - 1), training); k = 1 RSample: Gumbel -log(-log u)
  [S, E] on the logits (training); k = 2 with second-expert sampling: Gumbel [S, E] on the
  logits of the second choice; k = 1 random token selection (drop): priority u [S, E] times the
  route mask, the C largest kept per expert;
* k = 1 dropping without random token selection: DeepSpeed's ``torch.topk`` of the 0/1 route
  mask over the tokens, C per expert (which of equal values topk returns is the op's own
  choice, not the first C by position).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

JITTER = 1e-2


@dataclass(frozen=True)
class GateSpec:
    """The gate's arguments, DeepSpeed's names."""

    num_experts: int
    k: int = 1
    capacity_factor: float = 1.0
    min_capacity: int = 0
    noisy_gate_policy: str | None = None
    drop_tokens: bool = True
    use_rts: bool = False
    top2_2nd_expert_sampling: bool = False
    drop_policy: str = "probs"


def capacity(S: int, E: int, factor: float, k: int, min_capacity: int) -> int:
    """max(ceil(S / E x f k), min_capacity), the product rounded to fp32 as DeepSpeed does."""
    product = torch.tensor(S / E, dtype=torch.float32) * torch.tensor(factor * k, dtype=torch.float32)
    return max(int(torch.ceil(product)), min_capacity)


def gumbel(shape: Sequence[int], gen: torch.Generator) -> torch.Tensor:
    u = torch.rand(tuple(shape), generator=gen).clamp(min=1e-20)
    return -torch.log(-torch.log(u))


def _slot_onehot(loc: torch.Tensor, mask: torch.Tensor, C: int) -> torch.Tensor:
    """[S, E] slot index of each kept route -> [S, E, C] one-hot (zero where not kept)."""
    return F.one_hot((loc * mask).long(), C).float() * mask.unsqueeze(-1).float()


@dataclass
class GateOut:
    combine: torch.Tensor  # [S, E, C] fp32
    l_aux: torch.Tensor
    exp_counts: torch.Tensor  # [E]
    local_capacity: int  # this shard's C before the group agreed


def gate(
    x: torch.Tensor,
    wg: torch.Tensor,
    spec: GateSpec,
    gen: torch.Generator,
    agree: Callable[[int], int] = lambda c: c,
    training: bool = True,
    used_token: torch.Tensor | None = None,
) -> GateOut:
    """The routing of ``x`` [S, H] with gate weight ``wg`` [E, H] (module docstring)."""
    E, k = spec.num_experts, spec.k
    S = x.shape[0]
    x = x.float()
    if spec.noisy_gate_policy == "Jitter" and training:
        x = x * (1.0 + JITTER * (2 * torch.rand(tuple(x.shape), generator=gen) - 1))
    logits = x @ wg.float().t()
    probs = torch.softmax(logits, dim=-1)
    me = probs.mean(0)
    if k == 1:
        score = logits + gumbel(logits.shape, gen) if spec.noisy_gate_policy == "RSample" and training else probs
        mask = F.one_hot(score.argmax(-1), E)
        if used_token is not None:
            mask = torch.einsum("s,se->se", used_token, mask)  # DeepSpeed's op and dtype
        counts = mask.sum(0).long()
        l_aux = (me * mask.float().mean(0)).sum() * E
        local = _local_capacity(S, spec, counts)
        C = agree(local)
        if spec.drop_tokens:  # topk over tokens; without RTS ties are broken by the op itself
            priority = mask * torch.rand((S, E), generator=gen) if spec.use_rts else mask
            chosen = priority.topk(min(C, S), dim=0).indices
            mask = mask * torch.zeros_like(mask).scatter(0, chosen, 1)
        mask = mask.long()
        combine = (probs * mask).unsqueeze(-1) * _slot_onehot(mask.cumsum(0) - 1, mask, C)
        return GateOut(combine, l_aux, counts, local)
    if k == 2:
        mask1 = F.one_hot(probs.argmax(-1), E)
        second = logits + gumbel(logits.shape, gen) if spec.top2_2nd_expert_sampling else logits
        mask2 = F.one_hot(second.masked_fill(mask1.bool(), float("-inf")).argmax(-1), E)
        counts = (mask1 + mask2).sum(0)
        l_aux = (me * mask1.float().mean(0)).mean() * E * E
        local = _local_capacity(S, spec, counts)
        C = agree(local)
        loc1 = mask1.cumsum(0) - 1
        loc2 = mask2.cumsum(0) - 1 + mask1.sum(0)
        if spec.drop_tokens:
            mask1 = mask1 * (loc1 < C)
            mask2 = mask2 * (loc2 < C)
        g1 = (probs * mask1).sum(-1)
        g2 = (probs * mask2).sum(-1)
        denom = (g1 + g2).clamp(min=torch.finfo(torch.float32).eps)
        combine = ((g1 / denom)[:, None] * mask1).unsqueeze(-1) * _slot_onehot(loc1, mask1, C) + (
            (g2 / denom)[:, None] * mask2
        ).unsqueeze(-1) * _slot_onehot(loc2, mask2, C)
        return GateOut(combine, l_aux, counts, local)
    top_p, top_i = probs.topk(k, dim=-1)
    mask = torch.zeros_like(probs, dtype=torch.long).scatter(1, top_i, 1)
    counts = mask.sum(0)
    l_aux = (me * mask.float().mean(0)).mean() * E * E / k
    local = _local_capacity(S, spec, counts)
    C = agree(local)
    if spec.drop_tokens and spec.drop_policy == "probs":
        chosen = torch.zeros_like(probs).scatter(1, top_i, top_p).topk(min(C, S), dim=0).indices
        mask = mask * torch.zeros_like(mask).scatter(0, chosen, 1)
    loc = mask.cumsum(0) - 1
    if spec.drop_tokens and spec.drop_policy == "position":
        mask = mask * (loc < C)
    kept = probs * mask
    kept = kept / kept.sum(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).eps)
    combine = kept.unsqueeze(-1) * _slot_onehot(loc, mask, C)
    return GateOut(combine, l_aux, counts, local)


def _local_capacity(S: int, spec: GateSpec, counts: torch.Tensor) -> int:
    if spec.drop_tokens:
        return capacity(S, spec.num_experts, spec.capacity_factor, spec.k, spec.min_capacity)
    return int(counts.max())


@dataclass
class Expert:
    """fc2(act(fc1 x)) with whole weights: w1 [F, H], b1 [F], w2 [H, F], b2 [H]."""

    w1: torch.Tensor
    b1: torch.Tensor
    w2: torch.Tensor
    b2: torch.Tensor

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x @ self.w1.t() + self.b1) @ self.w2.t() + self.b2


def moe(
    x: torch.Tensor,
    wg: torch.Tensor,
    experts: Sequence[Expert],
    spec: GateSpec,
    gen: torch.Generator,
    agree: Callable[[int], int] = lambda c: c,
    training: bool = True,
) -> tuple[torch.Tensor, GateOut]:
    """GShard's MoE layer on ``x`` [S, H]: dispatch by einsum, every expert on its C slots, combine."""
    routing = gate(x, wg, spec, gen, agree, training)
    dispatch = (routing.combine != 0).to(x.dtype)
    expert_in = torch.einsum("sec,sm->ecm", dispatch, x)
    expert_out = torch.stack([expert(expert_in[e]) for e, expert in enumerate(experts)])
    return torch.einsum("sec,ecm->sm", routing.combine.to(x.dtype), expert_out), routing


def generator(seed: int, forward: int) -> torch.Generator:
    """The generator of forward n of a gate seeded ``seed``: manual_seed((seed + n 2654435761) mod 2^32)."""
    return torch.Generator().manual_seed((seed + forward * 2654435761) % 2**32)
