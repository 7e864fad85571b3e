"""Token dispatchers of a TED MoE layer: routed tokens -> expert slots -> combined outputs (001 §7.1).

The stage between the router (:class:`ds_ext.moe.gate.TopKGate`) and the experts, as
megatron-core's ``MoETokenDispatcher``: :meth:`TokenDispatcher.dispatch` permutes the tokens into
slots (:func:`ds_ext.moe.permutation.encode`) and sends them to the expert ranks (001 Fig 7.3 ❹);
:meth:`TokenDispatcher.combine` returns the experts' outputs (❼) and sums each token's routes
(:func:`~ds_ext.moe.permutation.decode`).

Sharding contract (E experts in dim 0, expert-major over P = G_expert ranks; C capacity slots in
dim 1; H hidden; T = G_tensor, t = tensor rank): ``dispatch`` takes tokens ``[S, H]`` replicated
over the tensor group and returns ``[E, C', H]``: for each expert rank j (chunk j of dim 0) the
slots of *my* experts that rank j filled; ``combine`` takes the experts' outputs in that layout.

* :class:`TokenDispatcher`: one all-to-all over the expert group each way; C' = C. Unbound
  (no TED groups) both exchanges are the identity.
* :class:`DTDDispatcher`, duplicate token dropping (001 §7.3.1, Fig 7.6): after a
  tensor-parallel block every tensor rank holds the same slots, so a plain all-to-all sends each
  token T times. Each way: drop (tensor rank t keeps slots ``[t C/T, (t+1) C/T)``) ->
  all-to-all -> all-gather over the tensor group; C' = C, and the result is the tensor a plain
  all-to-all of the undropped buffer delivers (DTD on and off are bit-identical). The backward
  mirrors it (the paper: "the all-gather call is replaced by a drop operation and the drop
  operation is replaced by an all-gather call").
* :class:`SlotShareDispatcher`, experts kept whole on every tensor rank (DeepSpeed's
  ``enable_expert_tensor_parallelism=False``): each tensor rank runs only its share, so dispatch
  drops -> all-to-all (C' = C/T) and combine all-to-all -> all-gathers.

CAC (001 §7.3.2): every forward collective records into the layer's frame; with the lean stash
the all-to-all outputs that only feed a tensor all-gather are not kept.
"""

from __future__ import annotations

import torch

from ds_ext.comm.mappings import all_to_all, gather_from_region, split_to_region
from ds_ext.moe.cac import Frame
from ds_ext.moe.context import TEDContext
from ds_ext.moe.gate import Routing
from ds_ext.moe.permutation import decode, encode, slots


class TokenDispatcher:
    """Permutation and one all-to-all over the expert group each way (see module)."""

    def __init__(self, ted: TEDContext | None, num_experts: int) -> None:
        self.comm = None if ted is None else ted.comm
        self.num_experts = num_experts
        self.expert_group = None if ted is None else ted.groups.expert
        self.tensor_group = None if ted is None else ted.groups.tensor
        self.lean = ted is not None and ted.cac_lean

    def dispatch(self, x: torch.Tensor, routing: Routing, frame: Frame) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens ``[S, H]`` -> ``([E, C', H]`` slots of this rank's experts, the route slots ``[k, S]``)."""
        route_slots = slots(routing.decision, self.num_experts)
        return self.send(encode(x, route_slots, self.num_experts, routing.decision.capacity), frame), route_slots

    def combine(self, y: torch.Tensor, route_slots: torch.Tensor, routing: Routing, frame: Frame) -> torch.Tensor:
        """The experts' outputs ``[E, C', H]`` -> tokens ``[S, H]``, routes summed by their gates."""
        return decode(self.receive(y, frame), route_slots, routing.gates)

    def exchange(self, x: torch.Tensor, frame: Frame, stash: bool = True) -> torch.Tensor:
        return all_to_all(x, self.comm, self.expert_group, frame, stash)

    def drop(self, x: torch.Tensor) -> torch.Tensor:
        return split_to_region(x, self.comm, self.tensor_group)

    def gather(self, x: torch.Tensor, frame: Frame) -> torch.Tensor:
        return gather_from_region(x, self.comm, self.tensor_group, frame)

    def send(self, x: torch.Tensor, frame: Frame) -> torch.Tensor:
        return self.exchange(x, frame)

    def receive(self, y: torch.Tensor, frame: Frame) -> torch.Tensor:
        return self.exchange(y, frame)


class DTDDispatcher(TokenDispatcher):
    """Drop -> all-to-all -> all-gather each way (see module)."""

    def send(self, x: torch.Tensor, frame: Frame) -> torch.Tensor:
        return self.gather(self.exchange(self.drop(x), frame, stash=not self.lean), frame)

    def receive(self, y: torch.Tensor, frame: Frame) -> torch.Tensor:
        return self.send(y, frame)


class SlotShareDispatcher(TokenDispatcher):
    """Whole experts on every tensor rank: each runs its C / T slots (see module)."""

    def send(self, x: torch.Tensor, frame: Frame) -> torch.Tensor:
        return self.exchange(self.drop(x), frame)

    def receive(self, y: torch.Tensor, frame: Frame) -> torch.Tensor:
        return self.gather(self.exchange(y, frame, stash=not self.lean), frame)


def token_dispatcher(ted: TEDContext | None, num_experts: int, experts_sliced: bool) -> TokenDispatcher:
    """The dispatcher of a layer bound to ``ted`` (None: unbound) whose experts are split over the
    tensor group (``experts_sliced``) or kept whole on every tensor rank.

    With G_expert = 1 there is no all-to-all for DTD to shrink (it would only add the all-gathers),
    so DTD then dispatches plainly whatever ``ted.dtd`` says."""
    if ted is None or ted.layout.tensor == 1:
        return TokenDispatcher(ted, num_experts)
    if not experts_sliced:
        return SlotShareDispatcher(ted, num_experts)
    if ted.dtd and ted.layout.expert > 1:
        return DTDDispatcher(ted, num_experts)
    return TokenDispatcher(ted, num_experts)
