"""Overlapping non-blocking collectives with computation (001 §5.1.4).

* OAR lives in the layer's backward (:mod:`ds_ext.pmm.linear`): the all-reduce of dL/dI is
  issued asynchronously and waited after the weight-gradient matmul.
* ORS, :class:`DeferredGradients`: each layer issues its weight-gradient reduce-scatter
  (and bias all-reduce) asynchronously and hands autograd the output buffer; one gate
  node, created at the model's forward start and tied into the first layer's input,
  waits for all of them after the last layer's backward and only then lets the
  gradients reach the parameters (so DeepSpeed's gradient hooks see finished values).
* OAG, :class:`AllGatherPrefetcher`: during the first grad-enabled step the order in
  which layers gather their weights is recorded (activation-checkpoint recomputes
  included: they run inside the first backward; no-grad passes are not recorded, their
  order is not a training step's); afterwards each gather issues the next one in that
  order asynchronously. A prefetch is used only if its weight is unchanged since it was
  issued (the parameter's version counter), every model forward drops what is in flight,
  and nothing is prefetched past the end of the recorded order, so no gathered weight
  outlives an optimizer step; a call out of order drops what is in flight.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ds_ext.comm import Handle


class _Gate(torch.autograd.Function):
    """Identity on the parameters; backward waits for the deferred reduce-scatters."""

    @staticmethod
    def forward(ctx, deferred: "DeferredGradients", seed: torch.Tensor, *params: torch.Tensor):
        ctx.deferred = deferred
        return (seed.new_zeros(()), *(p.view_as(p) for p in params))

    @staticmethod
    def backward(ctx, _token_grad, *grads):
        ctx.deferred.wait_all()
        return (None, None, *grads)


class DeferredGradients:
    """ORS: asynchronous weight-gradient reductions, waited once per backward pass."""

    def __init__(self) -> None:
        self._views: dict[int, torch.Tensor] = {}
        self._token: torch.Tensor | None = None
        self._pending: list[Handle] = []
        self.waited = 0  # deferred collectives completed by the gate (telemetry)

    def open(self, params: list[torch.nn.Parameter]) -> None:
        params = [p for p in params if p.requires_grad]
        if not params or not torch.is_grad_enabled():
            self._views, self._token = {}, None
            return
        token, *views = _Gate.apply(self, torch.zeros((), device=params[0].device), *params)
        self._views = {id(p): v for p, v in zip(params, views)}
        self._token = token

    def close(self) -> None:
        self._token = None

    def view(self, param: torch.nn.Parameter) -> torch.Tensor:
        return self._views.get(id(param), param)

    def gated(self, tensor: torch.Tensor) -> bool:
        return any(v is tensor for v in self._views.values())

    def tie(self, x: torch.Tensor) -> torch.Tensor:
        """Add the gate's zero token to the first layer input of the forward pass."""
        if self._token is None:
            return x
        token, self._token = self._token, None
        return x + token.to(x.dtype)

    def defer(self, handle: Handle) -> None:
        self._pending.append(handle)

    def wait_all(self) -> None:
        pending, self._pending = self._pending, []
        for h in pending:
            h.wait()
        self.waited += len(pending)


@dataclass
class _Ticket:
    layer: Any
    handle: Handle
    buffer: torch.Tensor
    version: int  # the weight's version counter when the gather was issued


class AllGatherPrefetcher:
    """OAG: one-ahead prefetch of weight all-gathers in the recorded execution order."""

    def __init__(self) -> None:
        self.order: list[Any] = []
        self.recording = True
        self._stop_queued = False
        self._cursor = 0
        self._inflight: dict[int, _Ticket] = {}
        self.hits = 0  # gathers served by a prefetch (telemetry)

    def weight(self, layer: Any, shard: torch.Tensor, grad_pass: bool) -> torch.Tensor:
        """The gathered weight block of ``layer`` (prefetched if it was issued); ``grad_pass``:
        the layer's forward runs with autograd on (only those passes are recorded)."""
        if self.recording:
            if grad_pass:
                self.order.append(layer)
            return layer.gather(shard)
        ticket = self._inflight.pop(id(layer), None)
        if ticket is not None:
            ticket.handle.wait()
        if ticket is not None and ticket.version == layer.weight._version:
            block = ticket.buffer
            self.hits += 1
        else:
            block = layer.gather(shard)
        self._advance(layer)
        return block

    def note_backward(self) -> None:
        """Called from a layer's backward: stop recording when the first backward ends."""
        if self.recording and not self._stop_queued:
            self._stop_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._stop_recording)

    def _stop_recording(self) -> None:
        self.recording = False

    def _advance(self, layer: Any) -> None:
        n = len(self.order)
        if n == 0:
            return
        if self.order[self._cursor % n] is not layer:
            self.drop()
            for off in range(n):
                if self.order[(self._cursor + off) % n] is layer:
                    self._cursor = (self._cursor + off) % n
                    break
            else:
                return
        self._cursor = self._cursor % n + 1
        if self._cursor < n:
            nxt = self.order[self._cursor]
            if id(nxt) not in self._inflight:
                handle, buffer = nxt.gather_async()
                self._inflight[id(nxt)] = _Ticket(nxt, handle, buffer, nxt.weight._version)

    def drop(self) -> None:
        """Complete and discard every prefetch in flight (weights may have changed)."""
        for t in self._inflight.values():
            t.handle.wait()
        self._inflight.clear()
