"""Top-1 / top-2 gate (001 §7.1 step ❸) with DeepSpeed-MoE's semantics.

Notation: S tokens of this rank, E experts, C capacity (slots per expert), k routes per token.

* logits = x W_g in fp32; gates = softmax(logits); top-1 takes argmax(gates) (RSample:
  argmax(logits + Gumbel noise)), top-2 adds argmax of the rest (with
  ``top2_2nd_expert_sampling``: of logits + Gumbel noise);
* capacity, ``drop_tokens=True``: C = max(ceil(S / E * f), min_capacity) with f the
  (eval) capacity factor, doubled for top-2; a route whose slot index reaches C is dropped
  (top-1 with ``use_rts``: the C tokens kept per expert are chosen at random, else by
  position). ``drop_tokens=False`` (dropless): C = the largest expert count, agreed by a MAX
  all-reduce over the expert group (the all-to-all needs one C on every rank; DeepSpeed
  issue #6809 hangs without it) and padded to a multiple of G_tensor for DTD;
* combine weight of a route: its gate (top-2: normalised over the token's kept routes);
* l_aux = E * sum_e mean_s(gates) * mean_s(first choice) (top-2: mean instead of sum, x E);
* exp_counts: routes per expert before dropping.

Noise and random token selection draw from a generator of this gate, seeded identically on
the ranks of a tensor group, so a tensor group routes identically (routers drifting apart
across TP ranks is a known failure, Megatron-LM #619, torchtitan #2387). Every decision is
a CAC frame decision: the recompute replays it (:mod:`ds_ext.moe.cac`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ds_ext.moe.cac import Frame

NOISY_GATE_POLICIES = (None, "None", "Jitter", "RSample")
JITTER_EPS = 1e-2


@dataclass(frozen=True)
class Decision:
    """Non-differentiable routing of S tokens: ``indices`` / ``locations`` ``[k, S]`` (expert
    and slot of each route, -1 = dropped), capacity C, first-choice fraction ``ce`` ``[E]``,
    routes per expert ``exp_counts`` ``[E]``."""

    indices: torch.Tensor
    locations: torch.Tensor
    capacity: int
    ce: torch.Tensor
    exp_counts: torch.Tensor


@dataclass(frozen=True)
class Routing:
    """A decision plus the differentiable combine weights ``gates`` ``[k, S]`` (fp32) and l_aux."""

    decision: Decision
    gates: torch.Tensor
    l_aux: torch.Tensor


def _gumbel(shape: torch.Size, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    u = torch.rand(shape, generator=gen, device=device).clamp_(min=1e-20)
    return -torch.log(-torch.log(u).clamp_(min=1e-20))


class TopKGate(nn.Module):
    """DeepSpeed's ``TopKGate`` (same ``wg`` parameter) computing a :class:`Routing`.

    ``agree_capacity(c)`` returns the dropless capacity agreed over the expert group and
    ``tensor_parallel`` is the multiple it is padded to (both set by the owning layer).
    """

    def __init__(self, model_dim: int, num_experts: int, k: int = 1, capacity_factor: float = 1.0,
                 eval_capacity_factor: float = 1.0, min_capacity: int = 8,
                 noisy_gate_policy: str | None = None, drop_tokens: bool = True, use_rts: bool = True,
                 top2_2nd_expert_sampling: bool = True) -> None:
        super().__init__()
        if k not in (1, 2):
            raise ValueError(f"ds_ext.ted: top_k (k) must be 1 or 2, got {k}")
        if noisy_gate_policy not in NOISY_GATE_POLICIES:
            raise ValueError(f"ds_ext.ted: noisy_gate_policy must be one of None, 'Jitter', 'RSample'; "
                             f"got {noisy_gate_policy!r}")
        if k == 2 and noisy_gate_policy == "RSample":
            raise ValueError("ds_ext.ted: noisy_gate_policy 'RSample' applies to top-1 gating only (DeepSpeed "
                             "silently ignores it with k=2); allowed with k=2: None, 'Jitter'")
        self.wg = nn.Linear(model_dim, num_experts, bias=False)
        self.k = k
        self.num_experts = num_experts
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = eval_capacity_factor
        self.min_capacity = min_capacity
        self.noisy_gate_policy = None if noisy_gate_policy == "None" else noisy_gate_policy
        self.drop_tokens = drop_tokens
        self.use_rts = use_rts
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling
        self.tensor_parallel = 1
        self.agree_capacity: Callable[[torch.Tensor], torch.Tensor] = lambda c: c
        self.generator: torch.Generator | None = None
        self.seed = 0

    def _gen(self, device: torch.device) -> torch.Generator:
        if self.generator is None or self.generator.device != device:
            self.generator = torch.Generator(device=device).manual_seed(self.seed)
        return self.generator

    def _decision_generator(self, device: torch.device) -> torch.Generator | None:
        """The generator of a decision that draws (as DeepSpeed: noise only in training,
        random token selection and top-2 sampling always)."""
        draws = (self.k == 1 and (self.use_rts or (self.training and self.noisy_gate_policy == "RSample"))) or (
            self.k == 2 and self.top2_2nd_expert_sampling)
        return self._gen(device) if draws else None

    def forward(self, x: torch.Tensor, used_token: torch.Tensor | None, frame: Frame) -> Routing:
        """``x``: ``[S, H]`` tokens (replicated over the tensor group)."""
        x32 = x.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            noise = frame.decision("jitter", lambda: 1.0 + JITTER_EPS * (
                2 * torch.rand(x32.shape, generator=self._gen(x.device), device=x.device) - 1))
            x32 = x32 * noise
        logits = F.linear(x32, self.wg.weight.float())
        decision = frame.decision("routing", lambda: self._decide(logits.detach(), used_token))
        gates = F.softmax(logits, dim=1)
        picked = gates.gather(1, decision.indices.clamp(min=0).t()).t() * (decision.indices >= 0)
        if self.k == 2:
            picked = picked / picked.sum(0, keepdim=True).clamp(min=torch.finfo(picked.dtype).eps)
        me = gates.mean(dim=0)
        l_aux = (me * decision.ce).sum() * self.num_experts if self.k == 1 else (
            (me * decision.ce).mean() * self.num_experts * self.num_experts)
        return Routing(decision, picked, l_aux)

    # ---- decisions (no gradient) -------------------------------------------------------
    def _capacity(self, S: int, exp_counts: torch.Tensor) -> int:
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        if self.drop_tokens:
            return max(math.ceil(S / self.num_experts * factor * self.k), self.min_capacity)
        c = self.agree_capacity(exp_counts.max().reshape(1))
        T = self.tensor_parallel
        return -(-int(c.item()) // T) * T

    def _decide(self, logits: torch.Tensor, used_token: torch.Tensor | None) -> Decision:
        S, E = logits.shape
        if S < self.min_capacity and self.drop_tokens:
            raise ValueError(f"ds_ext.ted: {S} tokens per rank < min_capacity {self.min_capacity}; "
                             "lower min_capacity or raise the micro-batch")
        gen = self._decision_generator(logits.device)
        gates = F.softmax(logits, dim=1)
        if self.noisy_gate_policy == "RSample" and self.training:
            first = torch.argmax(logits + _gumbel(logits.shape, gen, logits.device), dim=1)
        else:
            first = torch.argmax(gates, dim=1)
        mask1 = F.one_hot(first, E)
        if used_token is not None:
            mask1 = mask1 * used_token.reshape(-1, 1).to(mask1.dtype)
        ce = mask1.float().mean(dim=0)
        if self.k == 1:
            exp_counts = mask1.sum(0)
            C = self._capacity(S, exp_counts)
            if self.drop_tokens:
                mask1 = self._keep(mask1, C, gen if self.use_rts else None)
            loc1 = torch.cumsum(mask1, dim=0) - 1
            indices = torch.where(mask1.any(1), first, -1)[None]
            locations = (loc1 * mask1).sum(1)[None]
            return Decision(indices, locations, C, ce, exp_counts)
        second_logits = logits + _gumbel(logits.shape, gen, logits.device) if gen is not None else logits
        second = torch.argmax(second_logits.masked_fill(mask1.bool(), float("-inf")), dim=1)
        mask2 = F.one_hot(second, E)
        loc1 = torch.cumsum(mask1, dim=0) - 1
        loc2 = torch.cumsum(mask2, dim=0) - 1 + mask1.sum(0, keepdim=True)
        exp_counts = (mask1 + mask2).sum(0)
        C = self._capacity(S, exp_counts)
        if self.drop_tokens:
            mask1 = mask1 * (loc1 < C)
            mask2 = mask2 * (loc2 < C)
        indices = torch.stack([torch.where(mask1.any(1), first, -1), torch.where(mask2.any(1), second, -1)])
        locations = torch.stack([(loc1 * mask1).sum(1), (loc2 * mask2).sum(1)])
        return Decision(indices, locations, C, ce, exp_counts)

    @staticmethod
    def _keep(mask: torch.Tensor, C: int, gen: torch.Generator | None) -> torch.Tensor:
        """Keep at most C tokens per expert: the first C (by position) or, with ``gen``
        (random token selection), C drawn at random."""
        if gen is None:
            return mask * (torch.cumsum(mask, dim=0) <= C)
        priority = mask * torch.rand(mask.shape, generator=gen, device=mask.device)
        top = torch.topk(priority, k=min(C, mask.shape[0]), dim=0).indices
        return mask * torch.zeros_like(mask).scatter_(0, top, 1)


def all_reduce_max(comm, group) -> Callable[[torch.Tensor], torch.Tensor]:
    """``agree_capacity`` for a gate whose expert group is ``group``."""

    def agree(c: torch.Tensor) -> torch.Tensor:
        c = c.clone()
        comm.all_reduce(c, op=dist.ReduceOp.MAX, group=group)
        return c

    return agree
