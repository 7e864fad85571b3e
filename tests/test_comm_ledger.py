"""Collectives through ds_ext.comm on 8 gloo ranks emulating 2 nodes x 2 GPUs x 2 GCDs.

Every op is checked twice: its result against the value computed by hand, and its
ledger record against the closed-form bytes of the documented convention
(ds_ext/comm/ledger.py) at the level the group spans.
"""

import time

import pytest

WORLD_SIZE = 8
BLOCK = {"topology": {"preset": "frontier", "sizes": {"gpu": 2}, "emulate": True}}
# group name -> (partition kind, level, expected ledger level, group size)
GROUPS = {
    "gcd_pair": ("span", "gcd", "gcd", 2),
    "node": ("span", "gpu", "gpu", 4),
    "world": ("span", "node", "node", 8),
    "inter_node": ("cross", "node", "node", 2),
    "intra_node_cross": ("cross", "gpu", "gpu", 2),
}
_RT = {}


def _runtime(**comm):
    """One runtime per distinct comm config per worker (groups are created once)."""
    from ds_ext import config as cfgmod
    from ds_ext.runtime import Runtime

    key = tuple(sorted(comm.items()))
    if key not in _RT:
        _RT[key] = Runtime.create(cfgmod.parse({**BLOCK, "comm": comm}))
    rt = _RT[key]
    rt.ledger.reset()
    return rt


def _group(rt, name):
    kind, level, _, _ = GROUPS[name]
    return rt.groups.span(level) if kind == "span" else rt.groups.cross(level)


def _single_record(rt):
    step = rt.ledger.mark_step()
    assert len(step.bytes) == 1, dict(step.bytes)
    (((_, op, level), nbytes),) = step.bytes.items()
    assert sum(step.calls.values()) == 1
    return op, level, nbytes


def _check_ops(name, async_op):
    import torch
    import torch.distributed as dist

    rt = _runtime()
    g = _group(rt, name)
    ranks = rt.groups.ranks(g)
    d, me, rank = len(ranks), ranks.index(dist.get_rank()), dist.get_rank()
    level = GROUPS[name][2]
    n = 6
    out = {}

    def run(fn, *a, **kw):
        h = fn(*a, group=g, async_op=async_op, **kw)
        if async_op:
            assert h is not None
            h.wait()
        else:
            assert h is None

    # all_gather: n fp32 per rank -> n (d-1) * 4 bytes sent
    x = torch.full((n,), float(rank))
    y = torch.empty(n * d)
    run(rt.comm.all_gather, y, x)
    assert torch.equal(y, torch.tensor([float(r) for r in ranks]).repeat_interleave(n))
    out["all_gather"] = _single_record(rt)
    assert out["all_gather"] == ("all_gather", level, 4 * n * (d - 1))

    # reduce_scatter: S = 4 n d bytes in -> S (d-1)/d
    x = torch.arange(n * d, dtype=torch.float64) + rank
    y = torch.empty(n, dtype=torch.float64)
    run(rt.comm.reduce_scatter, y, x)
    expect = torch.arange(me * n, (me + 1) * n, dtype=torch.float64) * d + sum(ranks)
    assert torch.equal(y, expect)
    assert _single_record(rt) == ("reduce_scatter", level, pytest.approx(8 * n * d * (d - 1) / d))
    # MAX: the largest rank's chunk (gloo: reduced by the owner, not by torch's collective)
    run(rt.comm.reduce_scatter, y, x, op=dist.ReduceOp.MAX)
    assert torch.equal(y, torch.arange(me * n, (me + 1) * n, dtype=torch.float64) + max(ranks))
    _single_record(rt)

    # all_reduce on a 2-D bf16 tensor: 2 S (d-1)/d
    x = torch.full((3, n), float(rank + 1), dtype=torch.bfloat16)
    run(rt.comm.all_reduce, x)
    assert torch.equal(x, torch.full((3, n), float(sum(r + 1 for r in ranks)), dtype=torch.bfloat16))
    assert _single_record(rt) == ("all_reduce", level, pytest.approx(2 * 2 * 3 * n * (d - 1) / d))

    # even all_to_all over 2-D rows: rows addressed to others
    x = torch.stack([torch.full((n,), float(100 * rank + j)) for j in range(d)])
    y = torch.empty_like(x)
    run(rt.comm.all_to_all, y, x)
    assert torch.equal(y[:, 0], torch.tensor([100.0 * r + me for r in ranks]))
    assert _single_record(rt) == ("all_to_all", level, 4 * n * (d - 1))

    # uneven all_to_all: rank i sends j+1+i elements to group rank j
    send = [j + 1 + me for j in range(d)]
    recv = [me + 1 + i for i in range(d)]
    x = torch.cat([torch.full((s,), float(rank)) for s in send])
    y = torch.empty(sum(recv))
    run(rt.comm.all_to_all, y, x, output_split_sizes=recv, input_split_sizes=send)
    assert torch.equal(y, torch.cat([torch.full((s,), float(r)) for s, r in zip(recv, ranks)]))
    assert _single_record(rt) == ("all_to_all", level, 4 * (sum(send) - send[me]))

    # broadcast from the group's first rank: S (d-1)/d
    x = torch.full((n,), float(rank))
    run(rt.comm.broadcast, x, src=ranks[0])
    assert torch.equal(x, torch.full((n,), float(ranks[0])))
    assert _single_record(rt) == ("broadcast", level, pytest.approx(4 * n * (d - 1) / d))
    return out


@pytest.mark.parametrize("name", list(GROUPS))
@pytest.mark.parametrize("async_op", [False, True])
def test_ops_bytes_and_levels(world, name, async_op):
    results = world.run(_check_ops, name, async_op)
    _, _, level, d = GROUPS[name]
    assert all(r["all_gather"] == ("all_gather", level, 24 * (d - 1)) for r in results)


def _phases_and_steps():
    import torch

    rt = _runtime()
    node, pair = rt.groups.span("gpu"), rt.groups.span("gcd")
    x = torch.ones(10)
    for _ in range(2):
        with rt.ledger.phase("forward"):
            rt.comm.all_reduce(x, group=pair)
        with rt.ledger.phase("backward"):
            rt.comm.all_reduce(x, group=node)
            rt.comm.all_reduce(x, group=None)
        rt.ledger.mark_step()
    s = rt.ledger.steps[-1]
    assert s.by_phase() == {"forward": {"gcd": 40.0}, "backward": {"gpu": 60.0, "node": 70.0}}
    assert s.calls_by_level() == {"gcd": 1, "gpu": 1, "node": 1}
    assert rt.ledger.mean_by_level() == {"gcd": 40.0, "gpu": 60.0, "node": 70.0}
    assert rt.ledger.mean_calls_by_level() == {"gcd": 1.0, "gpu": 1.0, "node": 1.0}
    # a one-rank group moves nothing and is not recorded
    solo = rt.groups.group(tuple((r,) for r in range(8)))
    rt.comm.all_reduce(x, group=solo)
    assert rt.ledger.current.total() == 0
    return True


def test_phases_steps_and_means(world):
    assert all(world.run(_phases_and_steps))


def test_traffic_table_is_the_calling_ranks_own_ledger():
    """The table prints the ledger it is given, one rank's (no mean over ranks), and says so."""
    from ds_ext.comm.ledger import Ledger
    from ds_ext.report import traffic_table
    from ds_ext.topology import Topology, preset_levels

    topo = Topology.build(preset_levels("frontier"), 16, "frontier")
    ledger = Ledger(topo.level_names)
    for nbytes in (0, 300, 500):  # the warm-up step, then two steps of this rank
        ledger.record("all_gather", "node", nbytes)
        ledger.record_links("all_gather", {"gpu": nbytes * 1000})  # a ring: this rank's neighbour on its node
        ledger.mark_step()
    lines = traffic_table(ledger, topo, skip=1).splitlines()
    assert lines[-2].split()[:5] == ["node", "12.5", "400", "0.000", "0.000"]
    assert lines[-3].split()[:5] == ["gpu", "100", "0", "0.000", "0.400"]
    assert lines[-1].startswith("(bytes sent by this rank, mean over 2 optimizer steps; ")


def _instrumented_torch_distributed():
    import torch
    import torch.distributed as dist

    from ds_ext.comm import instrument_torch_distributed

    rt = _runtime()
    node = rt.groups.span("gpu")
    x = torch.ones(16)
    original = dist.all_reduce
    with instrument_torch_distributed(rt.comm):
        dist.all_reduce(x, group=node)  # third-party call: counted
        rt.comm.all_reduce(x, group=node)  # ds_ext call: counted once, not twice
        out = [torch.empty(4) for _ in range(8)]
        dist.all_gather(out, torch.ones(4))
        dist.all_to_all_single(torch.empty(16), torch.ones(16), group=None)
        w = dist.all_gather_into_tensor(torch.empty(32), torch.ones(4), async_op=True)
        w.wait()
        dist.all_gather_single(torch.empty(32), torch.ones(4))  # torch 2.13's names (FSDP2)
        dist.reduce_scatter_single(torch.empty(2), torch.ones(16))
    dist.all_reduce(x)  # after the block: not counted
    s = rt.ledger.mark_step()
    assert s.by_level(op="all_reduce") == {"gpu": 2 * 2 * 64 * 3 / 4}
    assert s.by_level(op="all_gather") == {"node": 3 * 16 * 7}
    assert s.by_level(op="reduce_scatter") == {"node": 64 * 7 / 8}
    assert s.by_level(op="all_to_all") == {"node": 64 * 7 / 8}
    return dist.all_reduce is original  # restored


def test_instrument_counts_third_party_once(world):
    assert all(world.run(_instrumented_torch_distributed))


def _wrapper_installed_after_import():
    """A profiler wraps torch.distributed after ``import ds_ext``: ds_ext's own collectives
    go through it, and so do third-party calls while the ledger is installed (chained)."""
    import functools

    import torch
    import torch.distributed as dist

    from ds_ext.comm import instrument_torch_distributed

    rt = _runtime()
    seen = []
    original = dist.all_reduce

    @functools.wraps(original)
    def profiler(*args, **kwargs):
        seen.append(args[0].numel())
        return original(*args, **kwargs)

    dist.all_reduce = profiler
    try:
        rt.comm.all_reduce(torch.ones(3))  # ds_ext's own call, not instrumented
        with instrument_torch_distributed(rt.comm):
            dist.all_reduce(torch.ones(5))  # third party: ledger, then the profiler
            rt.comm.all_reduce(torch.ones(7))  # ds_ext: the profiler, counted once
        counted = rt.ledger.current.calls_by_level()
        restored = dist.all_reduce is profiler
    finally:
        dist.all_reduce = original
    return seen, counted, restored


def test_a_wrapper_installed_after_import_is_called_and_chained(world):
    for seen, counted, restored in world.run(_wrapper_installed_after_import):
        assert seen == [3, 5, 7] and restored
        assert sum(counted.values()) == 3


def _timed_spans():
    """Timed spans (``Ledger.start`` / ``finish``): seconds for the ops issued, under the same
    keys as their bytes, none for the others."""
    import torch

    rt = _runtime()
    node = rt.groups.span("gpu")
    with rt.ledger.phase("forward"):
        rt.comm.all_reduce(torch.ones(1000), group=node)
        rt.comm.all_gather(torch.empty(8 * 100), torch.ones(100))
    with rt.ledger.paused():
        rt.comm.all_to_all(torch.empty(8), torch.ones(8))  # not recorded: no bytes, no seconds
    step = rt.ledger.mark_step()
    return dict(step.seconds), set(step.bytes), step.seconds_by_op()


def test_spans_time_the_ops_issued_and_nothing_else(world):
    for seconds, byte_keys, by_op in world.run(_timed_spans):
        assert set(seconds) == byte_keys == {("forward", "all_reduce", "gpu"), ("forward", "all_gather", "node")}
        assert all(t > 0 for t in seconds.values())
        assert set(by_op) == {"all_reduce", "all_gather"}


DELAY_S, DELAYED = 0.3, 5


def _delayed_peer():
    """Rank 5 sleeps before each world all-reduce (ds_ext's, then a third party's through the
    instrumentation): every other rank's span covers that wait, which no model of the transfer
    could know. Then every rank issues async all-reduces, sleeps, and waits: the spans run to
    ``wait()``, not to the issue's return."""
    import torch
    import torch.distributed as dist

    from ds_ext.comm import instrument_torch_distributed

    rt = _runtime()
    out = {}
    with instrument_torch_distributed(rt.comm):
        for name, all_reduce in (("comm", rt.comm.all_reduce), ("torch", dist.all_reduce)):
            dist.barrier()
            if dist.get_rank() == DELAYED:
                time.sleep(DELAY_S)
            all_reduce(torch.ones(4))
            out[name] = rt.ledger.mark_step().seconds_by_op()["all_reduce"]
        for name, issue in (
            ("comm_async", lambda x: rt.comm.all_reduce(x, async_op=True)),
            ("torch_async", lambda x: dist.all_reduce(x, async_op=True)),
        ):
            work = issue(torch.ones(4))
            before_wait = dict(rt.ledger.current.seconds)
            time.sleep(DELAY_S)
            work.wait()
            out[name] = (before_wait, rt.ledger.mark_step().seconds_by_op()["all_reduce"])
    return out


def test_spans_measure_waiting_for_a_late_peer_and_run_to_wait(world):
    results = world.run(_delayed_peer)
    for rank, r in enumerate(results):
        if rank != DELAYED:
            assert r["comm"] >= DELAY_S - 0.05 and r["torch"] >= DELAY_S - 0.05, (rank, r)
        for name in ("comm_async", "torch_async"):
            before_wait, seconds = r[name]
            assert before_wait == {} and seconds >= DELAY_S, (rank, name, r[name])
    assert results[DELAYED]["comm"] < DELAY_S / 2 and results[DELAYED]["torch"] < DELAY_S / 2


def test_synchronize_brackets_each_recorded_span():
    """``Ledger.synchronize`` (a GPU's device sync) runs where a recorded span starts and ends,
    never for a call the ledger does not record."""
    from ds_ext.comm.ledger import Ledger

    ledger = Ledger(("gcd", "node"))
    calls = []
    ledger.synchronize = lambda: calls.append(len(ledger.current.seconds))
    ledger.finish(ledger.start("all_to_all", "node"))
    assert calls == [0, 0] and set(ledger.current.seconds) == {("other", "all_to_all", "node")}
    with ledger.paused():
        ledger.finish(ledger.start("all_to_all", "node"))
    ledger.finish(ledger.start("all_to_all", None))  # a one-rank group
    assert calls == [0, 0] and ledger.current.calls == {}


def _time_emulation():
    import torch

    rt = _runtime(emulate_time=True, time_scale=2000.0)
    inter = rt.groups.cross("node")
    x = torch.zeros(2_500_000)  # 10 MB all-reduce over 2 nodes: 10 MB sent
    lv = rt.topology.level("node")
    cost = rt.comm.emulator.cost("all_reduce", "node", 10e6, 2)
    assert cost == pytest.approx(2000 * (2 * lv.latency + 10e6 / lv.bandwidth))
    t0 = time.perf_counter()
    rt.comm.all_reduce(x, group=inter)
    blocking = time.perf_counter() - t0
    t0 = time.perf_counter()
    h = rt.comm.all_reduce(x, group=inter, async_op=True)
    time.sleep(cost)  # "compute" that overlaps the collective
    h.wait()
    overlapped = time.perf_counter() - t0
    return cost, blocking, overlapped


def test_time_emulation_holds_and_overlaps(world):
    for cost, blocking, overlapped in world.run(_time_emulation):
        assert cost > 1.0
        assert blocking >= cost
        assert overlapped < 1.5 * cost  # async: the hold overlaps the sleep instead of adding to it


def _chunks_of(rank, numel):
    import torch

    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(numel, generator=g) * (1 + rank)


def _quantized_collectives():
    """int8 all-gather, 1-hop and 2-hop int4 all-to-all reduce vs a local simulation."""
    import torch
    import torch.distributed as dist

    from ds_ext.comm.quant import BlockQuantizer
    from ds_ext.comm.quantized import all_gather_int, all_to_all_reduce, all_to_all_reduce_2hop

    rt = _runtime()
    rank = dist.get_rank()
    q8, q4 = BlockQuantizer(8, 16), BlockQuantizer(4, 16)
    rt_ = lambda x, qz: qz.dequantize(qz.quantize(x))  # noqa: E731  (one quantize round trip)
    out = {}

    # int8 all-gather over the node (4 ranks, level gpu)
    node = rt.groups.span("gpu")
    members = rt.groups.ranks(node)
    got = torch.empty(4 * 32)
    all_gather_int(rt.comm, _chunks_of(rank, 32), q8, got, group=node)
    want = torch.cat([rt_(_chunks_of(r, 32), q8) for r in members])
    out["ag_exact"] = torch.equal(got, want)
    out["ag"] = _ledger_ops(rt)

    # 1-hop int4 all-to-all reduce over the world (8 ranks, level node)
    c = 32
    got = all_to_all_reduce(rt.comm, _chunks_of(rank, 8 * c), q4, group=None)
    want = sum(rt_(_chunks_of(r, 8 * c), q4).view(8, c)[rank] for r in range(8))
    out["a2a_err"] = (got - want).abs().max().item()
    out["a2a"] = _ledger_ops(rt)

    # 2-hop: inside the node (P=4) then across nodes (N=2); layout [p, n, c]
    inter = rt.groups.cross("node")
    got = all_to_all_reduce_2hop(rt.comm, _chunks_of(rank, 8 * c), q4, node, inter)
    inn = rt.groups.ranks(inter).index(rank)

    def partial(r):  # what rank r holds after the first hop: [N * c]
        mem = [m for m in range(8) if m // 4 == r // 4]
        return sum(rt_(_chunks_of(m, 8 * c), q4).view(4, 2 * c)[mem.index(r)] for m in mem)

    peers = rt.groups.ranks(inter)
    want = sum(rt_(partial(r), q4).view(2, c)[inn] for r in peers)
    out["hop2_err"] = (got - want).abs().max().item()
    out["hop2"] = _ledger_ops(rt)
    return out


def _ledger_ops(rt):
    step = rt.ledger.mark_step()
    return {f"{op}@{lv}": (b, step.calls[(ph, op, lv)]) for (ph, op, lv), b in step.bytes.items()}


def test_quantized_collectives(world):
    for r in world.run(_quantized_collectives):
        assert r["ag_exact"]
        # payload 32 int8 + 2 fp32 scales per rank, sent to 3 peers, as two calls
        assert r["ag"] == {"all_gather@gpu": ((32 + 2 * 4) * 3, 2)}
        assert r["a2a_err"] < 1e-5
        # 256 int4 codes = 128 bytes + 16 scales = 64 bytes, 7/8 addressed to others
        assert r["a2a"] == {"all_to_all@node": ((128 + 64) * 7 / 8, 2)}
        assert r["hop2_err"] < 1e-5
        # hop 1 inside the node: 3/4 of the same 192 bytes; hop 2: 64 values = 32 + 4*4 bytes, half
        assert r["hop2"] == {"all_to_all@gpu": (192 * 3 / 4, 2), "all_to_all@node": ((32 + 16) / 2, 2)}
