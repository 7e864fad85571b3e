"""Top-k gate (001 §7.1 step ❸) with DeepSpeed-MoE's semantics (``deepspeed/moe/sharded_moe.py``).

Notation: S tokens of this rank, E experts, C capacity (slots per expert), k routes per token,
T = G_tensor, f the capacity factor (``eval_capacity_factor`` in evaluation).

* logits = x W_g in fp32 (``Jitter``: x multiplied by U(1 - 1e-2, 1 + 1e-2) in training);
  gates = softmax(logits);
* k = 1: argmax(gates) (``RSample`` in training: argmax(logits + Gumbel noise)); ``used_token``
  masks tokens out; with ``drop_tokens`` an expert keeps the C tokens ``torch.topk`` over the
  token dimension picks from its route mask, times U(0, 1) priorities with ``use_rts`` (random
  token selection) or the 0/1 mask itself (see :meth:`TopKGate._keep`);
* k = 2: argmax, then argmax of the rest (``top2_2nd_expert_sampling``: of logits + Gumbel
  noise); second routes queue behind all first routes; slots past C dropped; ``used_token``
  ignored (as DeepSpeed's ``top2gating``);
* k >= 3 (DeepSpeed's ``topkgating``): the k largest gates; with ``drop_tokens`` an expert keeps
  the C routes of largest gate (``drop_policy="probs"``) or the first C by position
  (``"position"``);
* capacity, ``drop_tokens=True``: ceil(S / E x f k) computed in fp32 (DeepSpeed's dtype, see
  :func:`drop_capacity`), at least ``min_capacity``; ``drop_tokens=False`` (dropless): the
  largest expert count. Either way the value is agreed by a MAX all-reduce over the expert
  group (the all-to-all needs one C on every rank: ranks with different token counts would
  otherwise hang, as DeepSpeed's dropless path did in deepspeedai/DeepSpeed#6809) and the dispatch buffer is
  padded to a multiple of T (DTD splits it over the tensor group; padded slots stay empty);
* combine weight of a route: its gate (k >= 2: normalised over the token's kept routes);
* l_aux = E sum_e mean_s(gates) mean_s(first choice) (k = 2: E^2 mean_e(...); k >= 3:
  E^2 / k mean_e(me x mean_s(all k choices)));
* exp_counts: routes per expert before dropping.

Random draws: forward n of a gate draws (jitter, then RSample / top-2 Gumbel noise, then random
token selection) from ``torch.Generator().manual_seed((seed + n x 2654435761) mod 2^32)`` (torch's
CPU generator keeps 32 bits of a seed; within one forward, gates of distinct seeds draw distinct
noise). ``seed`` is equal on the ranks of a tensor group, so a tensor group routes identically (routers drifting apart
across TP ranks is a known failure, Megatron-LM #619, torchtitan #2387); ``draws`` (n) is the
same on every rank and travels in checkpoints (:mod:`ds_ext.moe.plugin`). Every decision is a
CAC frame decision: the recompute replays it (:mod:`ds_ext.moe.cac`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ds_ext.moe import TEDError
from ds_ext.moe.cac import Frame

NOISY_GATE_POLICIES = (None, "None", "Jitter", "RSample")
DROP_POLICIES = ("probs", "position")
JITTER_EPS = 1e-2
DRAW_STRIDE = 2654435761  # odd, about 2^32 / golden ratio: forwards of one gate spread over the seeds


@dataclass(frozen=True)
class Decision:
    """Non-differentiable routing of S tokens: ``indices`` / ``locations`` ``[k, S]`` (expert
    and slot of each route, -1 = dropped), ``capacity`` (buffer slots per expert: the agreed C
    padded to a multiple of G_tensor), first-choice fraction ``ce`` ``[E]``, routes per expert
    ``exp_counts`` ``[E]``."""

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


def drop_capacity(tokens: int, num_experts: int, capacity_factor: float, k: int, min_capacity: int) -> int:
    """C = max(ceil(S / E x f k), min_capacity) with the product in fp32, as DeepSpeed's
    ``_capacity(gates, torch.tensor(f * k), ...)`` computes it (a Python float times an fp32
    tensor is an fp32 product)."""
    c = int(torch.ceil(torch.tensor(capacity_factor * k) * (tokens / num_experts)).item())
    return max(c, min_capacity)


def _gumbel(shape: torch.Size, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """Standard Gumbel noise -log(-log(u)), u ~ U(0, 1) (both logs kept finite)."""
    u = torch.rand(shape, generator=gen, device=device).clamp_(min=1e-20)
    return -torch.log((-torch.log(u)).clamp_(min=1e-20))


def _check_factor(name: str, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise TEDError(f"ds_ext.ted: {name} must be a finite number > 0, got {value!r}")


class TopKGate(nn.Module):
    """DeepSpeed's ``TopKGate`` (same ``wg`` parameter) computing a :class:`Routing`.

    ``agree_capacity(c)`` returns the capacity agreed over the expert group and
    ``tensor_parallel`` is the multiple the buffer is padded to (both set by the owning layer).
    """

    def __init__(
        self,
        model_dim: int,
        num_experts: int,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 8,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        top2_2nd_expert_sampling: bool = True,
        drop_policy: str = "probs",
    ) -> None:
        super().__init__()
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= num_experts:
            raise TEDError(f"ds_ext.ted: top_k (k) must be an integer in 1..num_experts ({num_experts}), got {k!r}")
        _check_factor("capacity_factor", capacity_factor)
        _check_factor("eval_capacity_factor", eval_capacity_factor)
        if isinstance(min_capacity, bool) or not isinstance(min_capacity, int) or min_capacity < 0:
            raise TEDError(f"ds_ext.ted: min_capacity must be an integer >= 0, got {min_capacity!r}")
        if noisy_gate_policy not in NOISY_GATE_POLICIES:
            raise TEDError(
                f"ds_ext.ted: noisy_gate_policy must be one of None, 'Jitter', 'RSample'; got {noisy_gate_policy!r}"
            )
        if k > 1 and noisy_gate_policy == "RSample":
            raise TEDError(
                f"ds_ext.ted: noisy_gate_policy 'RSample' applies to top-1 gating only (DeepSpeed "
                f"silently ignores it with k={k}); allowed with k > 1: None, 'Jitter'"
            )
        if drop_policy not in DROP_POLICIES:
            raise TEDError(f"ds_ext.ted: drop_policy must be one of 'probs', 'position'; got {drop_policy!r}")
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
        self.drop_policy = drop_policy
        self.tensor_parallel = 1
        self.agree_capacity: Callable[[torch.Tensor], torch.Tensor] = lambda c: c
        self.seed = 0
        self.draws = 0

    def next_generator(self, device: torch.device) -> torch.Generator:
        """The generator of this forward's draws (module docstring); advances ``draws``."""
        gen = torch.Generator(device=device).manual_seed((self.seed + self.draws * DRAW_STRIDE) % 2**32)
        self.draws += 1
        return gen

    def forward(self, x: torch.Tensor, used_token: torch.Tensor | None, frame: Frame) -> Routing:
        """``x``: ``[S, H]`` tokens (replicated over the tensor group)."""
        x32 = x.float()
        gen = None if frame.mode == "replay" else self.next_generator(x.device)
        if self.noisy_gate_policy == "Jitter" and self.training:
            noise = frame.decision(
                "jitter", lambda: 1.0 + JITTER_EPS * (2 * torch.rand(x32.shape, generator=gen, device=x.device) - 1)
            )
            x32 = x32 * noise
        logits = F.linear(x32, self.wg.weight.float())
        decision = frame.decision("routing", lambda: self._decide(logits.detach(), used_token, gen))
        gates = F.softmax(logits, dim=1)
        picked = gates.gather(1, decision.indices.clamp(min=0).t()).t() * (decision.indices >= 0)
        if self.k > 1:
            picked = picked / picked.sum(0, keepdim=True).clamp(min=torch.finfo(picked.dtype).eps)
        me = gates.mean(dim=0)
        E = self.num_experts
        if self.k == 1:
            l_aux = (me * decision.ce).sum() * E
        elif self.k == 2:
            l_aux = (me * decision.ce).mean() * E * E
        else:
            l_aux = (me * decision.ce).mean() * E * E / self.k
        return Routing(decision, picked, l_aux)

    # ---- decisions (no gradient) -------------------------------------------------------
    def _capacity(self, S: int, exp_counts: torch.Tensor) -> tuple[int, int]:
        """(C routes kept per expert, buffer slots = C padded to a multiple of G_tensor)."""
        if self.drop_tokens:
            factor = self.capacity_factor if self.training else self.eval_capacity_factor
            local = torch.tensor(
                [drop_capacity(S, self.num_experts, factor, self.k, self.min_capacity)], device=exp_counts.device
            )
        else:
            local = exp_counts.max().reshape(1)
        C = int(self.agree_capacity(local.to(torch.int64)).item())
        T = self.tensor_parallel
        return C, -(-C // T) * T

    def _decide(self, logits: torch.Tensor, used_token: torch.Tensor | None, gen: torch.Generator | None) -> Decision:
        S, E = logits.shape
        if S < self.min_capacity and self.drop_tokens:
            raise TEDError(
                f"ds_ext.ted: {S} tokens per rank < min_capacity {self.min_capacity}; "
                "lower min_capacity or raise the micro-batch"
            )
        if self.k == 1:
            return self._top1(logits, used_token, gen)
        if self.k == 2:
            return self._top2(logits, gen)
        return self._topk(logits)

    def _top1(self, logits: torch.Tensor, used_token: torch.Tensor | None, gen: torch.Generator) -> Decision:
        S, E = logits.shape
        if self.noisy_gate_policy == "RSample" and self.training:
            first = torch.argmax(logits + _gumbel(logits.shape, gen, logits.device), dim=1)
        else:
            first = torch.argmax(F.softmax(logits, dim=1), dim=1)
        mask1 = F.one_hot(first, E)
        if used_token is not None:  # DeepSpeed's op: the mask's dtype (int64, or float) is what _keep ranks
            mask1 = torch.einsum("s,se->se", used_token.reshape(-1), mask1)
        ce = mask1.float().mean(dim=0)
        exp_counts = mask1.sum(0).to(torch.int64)
        C, slots = self._capacity(S, exp_counts)
        if self.drop_tokens:
            mask1 = self._keep(mask1, C, gen if self.use_rts else None)
        mask1 = mask1.to(torch.int64)
        loc1 = torch.cumsum(mask1, dim=0) - 1
        indices = torch.where(mask1.any(1), first, -1)[None]
        locations = (loc1 * mask1).sum(1)[None]
        return Decision(indices, locations, slots, ce, exp_counts)

    def _top2(self, logits: torch.Tensor, gen: torch.Generator) -> Decision:
        S, E = logits.shape
        first = torch.argmax(F.softmax(logits, dim=1), dim=1)
        mask1 = F.one_hot(first, E)
        second_logits = logits + _gumbel(logits.shape, gen, logits.device) if self.top2_2nd_expert_sampling else logits
        second = torch.argmax(second_logits.masked_fill(mask1.bool(), float("-inf")), dim=1)
        mask2 = F.one_hot(second, E)
        loc1 = torch.cumsum(mask1, dim=0) - 1
        loc2 = torch.cumsum(mask2, dim=0) - 1 + mask1.sum(0, keepdim=True)
        ce = mask1.float().mean(dim=0)
        exp_counts = (mask1 + mask2).sum(0)
        C, slots = self._capacity(S, exp_counts)
        if self.drop_tokens:
            mask1 = mask1 * (loc1 < C)
            mask2 = mask2 * (loc2 < C)
        indices = torch.stack([torch.where(mask1.any(1), first, -1), torch.where(mask2.any(1), second, -1)])
        locations = torch.stack([(loc1 * mask1).sum(1), (loc2 * mask2).sum(1)])
        return Decision(indices, locations, slots, ce, exp_counts)

    def _topk(self, logits: torch.Tensor) -> Decision:
        S, E = logits.shape
        gates = F.softmax(logits, dim=1)
        top_gate, top_idx = torch.topk(gates, k=self.k, dim=1)
        mask = torch.zeros_like(gates, dtype=torch.long).scatter_(1, top_idx, 1)
        ce = mask.float().mean(dim=0)
        exp_counts = mask.sum(0)
        C, slots = self._capacity(S, exp_counts)
        if self.drop_tokens and self.drop_policy == "probs":
            by_prob = torch.zeros_like(gates).scatter(1, top_idx, top_gate)
            kept = torch.topk(by_prob, k=min(C, S), dim=0, sorted=False).indices
            mask = mask * torch.zeros_like(mask).scatter_(0, kept, 1)
        loc = torch.cumsum(mask, dim=0) - 1
        if self.drop_tokens and self.drop_policy == "position":
            mask = mask * (loc < C)
        route_kept = mask.gather(1, top_idx).bool()
        indices = torch.where(route_kept, top_idx, -1).t()
        locations = (loc.gather(1, top_idx) * route_kept).t()
        return Decision(indices.contiguous(), locations.contiguous(), slots, ce, exp_counts)

    @staticmethod
    def _keep(mask: torch.Tensor, C: int, gen: torch.Generator | None) -> torch.Tensor:
        """Keep at most C tokens per expert as DeepSpeed's ``top1gating`` does: ``torch.topk`` over
        the token dimension of the route mask times U(0, 1) priorities (``gen``: random token
        selection) or of the 0/1 mask itself. Among equal values topk's choice is
        implementation-defined (neither the first nor the last C by position, and it differs
        between CPU and CUDA), so this calls the same op on a tensor of the same dtype and values
        as DeepSpeed to keep the same tokens."""
        priority = mask if gen is None else mask * torch.rand(mask.shape, generator=gen, device=mask.device)
        top = torch.topk(priority, k=min(C, mask.shape[0]), dim=0).indices
        return mask * torch.zeros_like(mask).scatter_(0, top, 1)


def all_reduce_max(comm, group) -> Callable[[torch.Tensor], torch.Tensor]:
    """``agree_capacity`` for a gate whose expert group is ``group``."""

    def agree(c: torch.Tensor) -> torch.Tensor:
        c = c.clone()
        comm.all_reduce(c, op=dist.ReduceOp.MAX, group=group)
        return c

    return agree
