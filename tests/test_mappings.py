"""The one mappings module (:mod:`ds_ext.comm.mappings`) and the stages of a TED MoE layer (no processes).

A fake communicator plays rank ``r`` of a group of ``d`` ranks that all hold the same tensor,
so each collective has a known result: all-reduce multiplies by d, all-gather repeats the
chunk d times, all-to-all returns chunk r from every rank. Each mapping's forward and backward
must make exactly the collectives of its sharding contract; a CAC recorder's replay makes none.
The TED layer is router -> dispatcher -> experts, and the dispatcher matches the layout
(plain / DTD / slot share).
"""

import importlib.util
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from ds_ext.comm import mappings as m

GROUP = object()


@dataclass
class FakeComm:
    d: int = 2
    r: int = 1
    calls: list = field(default_factory=list)

    def __post_init__(self):
        self.registry = SimpleNamespace(group_rank=lambda group: self.r)

    def size(self, group):
        return self.d if group is GROUP else 1

    def all_reduce(self, t, group=None):
        self.calls.append(("all_reduce", tuple(t.shape)))
        t.mul_(self.d)

    def all_gather(self, out, inp, group=None):
        self.calls.append(("all_gather", tuple(inp.shape)))
        out.copy_(inp.unsqueeze(0).expand_as(out))

    def all_to_all(self, out, inp, group=None):
        self.calls.append(("all_to_all", tuple(inp.shape)))
        mine = inp.chunk(self.d)[self.r]
        out.copy_(torch.cat([mine] * self.d))


def _leaf(*shape):
    return torch.arange(float(torch.tensor(shape).prod())).reshape(shape).requires_grad_()


def test_old_copies_are_gone():
    for name in ("ds_ext.moe.collectives", "ds_ext.pmm.ops", "ds_ext.moe.dtd"):
        assert importlib.util.find_spec(name) is None, name


def test_f_copy_to_region_reduces_only_the_gradient():
    comm, x = FakeComm(), _leaf(3, 4)
    y = m.copy_to_region(x, comm, GROUP)
    assert torch.equal(y, x) and comm.calls == []
    y.backward(torch.ones_like(y))
    assert comm.calls == [("all_reduce", (3, 4))] and torch.equal(x.grad, torch.full((3, 4), 2.0))


def test_g_reduce_from_region_reduces_only_the_forward():
    comm, x = FakeComm(), _leaf(3, 4)
    y = m.reduce_from_region(x, comm, GROUP)
    assert torch.equal(y, 2 * x) and comm.calls == [("all_reduce", (3, 4))]
    y.backward(torch.ones_like(y))
    assert len(comm.calls) == 1 and torch.equal(x.grad, torch.ones(3, 4))


def test_reduce_both_and_mean_over():
    comm, x = FakeComm(d=4), _leaf(2)
    y = m.reduce_both(x, comm, GROUP)
    y.backward(torch.ones(2))
    assert torch.equal(y, 4 * x) and torch.equal(x.grad, torch.full((2,), 4.0)) and len(comm.calls) == 2
    comm, x = FakeComm(d=4), _leaf(2)
    y = m.mean_over(x, comm, GROUP)
    y.backward(torch.ones(2))
    assert torch.equal(y, x) and torch.equal(x.grad, torch.full((2,), 0.25)) and len(comm.calls) == 1


def test_bucketed_copy_reduces_one_buffer_per_dtype():
    comm = FakeComm()
    xs = [_leaf(2, 3), _leaf(5), torch.ones(4, dtype=torch.float64, requires_grad=True)]
    views = m.copy_to_region_bucketed(xs, comm, GROUP)
    sum(v.sum() for v in views).backward()
    assert sorted(comm.calls) == [("all_reduce", (4,)), ("all_reduce", (11,))]
    assert all(torch.equal(x.grad, torch.full_like(x, 2.0)) for x in xs)


def test_all_to_all_exchanges_both_ways():
    comm, x = FakeComm(), _leaf(4, 3)
    y = m.all_to_all(x, comm, GROUP)
    assert torch.equal(y, torch.cat([x[2:]] * 2))
    y.backward(torch.ones_like(y))
    assert comm.calls == [("all_to_all", (4, 3))] * 2


def test_split_and_gather_mirror_each_other():
    """DTD's drop keeps chunk r of dim 1 (backward: all-gather); the gather concatenates the chunks
    in rank order (backward: keep chunk r)."""
    comm, x = FakeComm(), _leaf(2, 4, 3)
    part = m.split_to_region(x, comm, GROUP)
    assert torch.equal(part, x[:, 2:]) and comm.calls == []
    whole = m.gather_from_region(part, comm, GROUP)
    assert whole.shape == x.shape and torch.equal(whole, torch.cat([x[:, 2:]] * 2, dim=1))
    whole.backward(torch.ones_like(whole))
    assert [c for c, _ in comm.calls] == ["all_gather", "all_gather"]
    assert torch.equal(x.grad, torch.ones_like(x))  # gather's backward keeps chunk r, split's gathers it


def test_recorder_replay_skips_forward_collectives():
    from ds_ext.moe.cac import Frame

    comm, x = FakeComm(), _leaf(2, 4, 3)
    frame = Frame("t", "record", cac=True)
    first = (
        m.reduce_from_region(x, comm, GROUP, frame),
        m.all_to_all(x, comm, GROUP, frame),
        m.gather_from_region(x, comm, GROUP, frame),
    )
    n = len(comm.calls)
    frame.mode = "replay"
    again = (
        m.reduce_from_region(x, comm, GROUP, frame),
        m.all_to_all(x, comm, GROUP, frame),
        m.gather_from_region(x, comm, GROUP, frame),
    )
    assert n == 3 and len(comm.calls) == 3
    assert all(torch.equal(a, b) for a, b in zip(first, again))


@pytest.mark.parametrize("group", [None, "one"])
def test_group_of_one_rank_is_the_identity(group):
    class Untouchable(FakeComm):
        def __getattr__(self, name):
            raise AssertionError(f"communicator used: {name}")

    comm, x = Untouchable(d=1), _leaf(2, 2, 2)
    for op in (
        m.copy_to_region,
        m.reduce_from_region,
        m.reduce_both,
        m.mean_over,
        m.all_to_all,
        m.split_to_region,
        m.gather_from_region,
    ):
        assert op(x, comm, group) is x
    assert m.copy_to_region_bucketed([x], comm, group) == (x,)
    assert comm.calls == []


def _ted(tensor, expert, dtd=True):
    layout = SimpleNamespace(tensor=tensor, expert=expert)
    return SimpleNamespace(
        layout=layout, comm=FakeComm(), groups=SimpleNamespace(expert=GROUP, tensor=GROUP), dtd=dtd, cac_lean=False
    )


@pytest.mark.parametrize(
    "tensor, expert, dtd, sliced, kind",
    [
        (1, 4, True, True, "TokenDispatcher"),
        (2, 4, True, True, "DTDDispatcher"),
        (2, 4, False, True, "TokenDispatcher"),
        (2, 1, True, True, "TokenDispatcher"),  # no all-to-all for DTD to shrink
        (2, 4, True, False, "SlotShareDispatcher"),
        (2, 1, True, False, "SlotShareDispatcher"),
    ],
)
def test_dispatcher_follows_the_layout(tensor, expert, dtd, sliced, kind):
    from ds_ext.moe.dispatcher import token_dispatcher

    assert type(token_dispatcher(_ted(tensor, expert, dtd), 4, sliced)).__name__ == kind
    assert type(token_dispatcher(None, 4, sliced)).__name__ == "TokenDispatcher"


def test_ted_moe_is_router_dispatcher_experts():
    """Unbound, the layer's output is the three stages composed by hand."""
    from ds_ext.moe.cac import Frame
    from ds_ext.moe.layer import TEDMoE

    torch.manual_seed(0)
    layer = TEDMoE(8, nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)), num_experts=4, k=2, min_capacity=0)
    x = torch.randn(3, 5, 8)
    draws = layer.gate.draws
    out, l_aux, counts = layer(x)
    layer.gate.draws = draws  # the same noise again
    frame = Frame("t", "plain", cac=False)
    routing = layer.gate(x.reshape(-1, 8), None, frame)
    tokens, route_slots = layer.dispatcher.dispatch(x.reshape(-1, 8), routing, frame)
    y = layer.deepspeed_moe.experts(tokens.view(1, 4, tokens.shape[1], 8), frame).reshape(tokens.shape)
    by_hand = layer.dispatcher.combine(y, route_slots, routing, frame)
    assert torch.equal(out, by_hand.reshape(x.shape)) and torch.equal(l_aux, routing.l_aux)
    assert torch.equal(counts, routing.decision.exp_counts)
