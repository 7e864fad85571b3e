"""Ring and PCCL all-gather / reduce-scatter (001 §6.2) on 8 gloo ranks, groups of 2-8 ranks.

References, independent of ds_ext.comm.algorithms:
* all-gather: torch.distributed.all_gather_into_tensor on the same group, bit for bit;
* reduce-scatter: a hand-written summation in the order the module docstring states
  (ring: x_{b+1} + x_{b+2} + ... + x_b left to right; pccl: that ring inside each node, then
  across N nodes the pairwise tree T_k(r) = T_{k+1}(r) + T_{k+1}(r XOR 2^k) for N a power of
  two, else the dissemination tree S_k(r, q) = S_{k+1}(r, q) + S_{k+1}(r - 2^k, q + 2^k)),
  from every rank's input regenerated locally from its seed, bit for bit;
* ledger: bytes and messages per level == ds_ext.perf.collectives, whose formulas are checked
  against numbers worked out by hand in the pure-logic tests.
"""

import math
import subprocess
import sys
from pathlib import Path

import pytest

WORLD_SIZE = 8

# topology name -> levels (innermost first; the outermost size follows from the world size)
TOPOLOGIES = {
    "2x4": [("gcd", 2, 200.0, 5.0), ("gpu", 2, 50.0, 8.0), ("node", None, 12.5, 15.0)],
    "4x2": [("local", 2, 50.0, 8.0), ("node", None, 12.5, 15.0)],
    "8x1": [("local", 1, 50.0, 8.0), ("node", None, 12.5, 15.0)],
}
# (topology, partition): this rank's group of the partition; covers N = 1..8 nodes,
# M = 1, 2, 4 ranks per node, non-powers of two N = 3, 5, 7 and group sizes 2..8
CASES = [
    ("2x4", (tuple(range(8)),)),  # N=2, M=4, three levels
    ("2x4", ((0, 1, 2, 3), (4, 5, 6, 7))),  # one node: N=1, M=4
    ("2x4", ((0, 4), (1, 5), (2, 6), (3, 7))),  # N=2, M=1
    ("4x2", (tuple(range(8)),)),  # N=4, M=2
    ("4x2", ((0, 1, 2, 3, 4, 5), (6, 7))),  # N=3, M=2 and N=1, M=2
    ("4x2", ((0, 2, 4), (1, 3, 5), (6,), (7,))),  # N=3, M=1
    ("8x1", (tuple(range(8)),)),  # N=8
    ("8x1", ((0, 1, 2, 3, 4), (5, 6, 7))),  # N=5 and N=3
    ("8x1", ((0, 1, 2, 3, 4, 5, 6), (7,))),  # N=7
]
_REG = {}


def _topology(name):
    from ds_ext.topology import GB, US, Level, Topology

    return Topology.build([Level(n, s, bw * GB, lat * US) for n, s, bw, lat in TOPOLOGIES[name]], 8, name)


def _comm(name):
    """One registry and communicator per topology per worker (groups are created once)."""
    from ds_ext.comm import Communicator
    from ds_ext.groups import GroupRegistry
    from ds_ext.perf import collectives

    if name not in _REG:
        _REG[name] = Communicator(GroupRegistry(_topology(name)), model=collectives)
    comm = _REG[name]
    comm.ledger.reset()
    return comm


def _input(rank, numel, dtype, salt):
    import torch

    g = torch.Generator().manual_seed(1000 * salt + rank)
    return (torch.randn(numel, generator=g) * (1 + rank)).to(dtype)


# ---- hand-written reduce-scatter references -------------------------------------------------


def _ring_sum(values, b):
    """values[k] of d ranks, block b: ((v_{b+1} + v_{b+2}) + ...) + v_b."""
    d = len(values)
    acc = values[(b + 1) % d]
    for s in range(2, d + 1):
        acc = acc + values[(b + s) % d]
    return acc


def _pccl_sum(x, nodes, i, j, c):
    """Block (i, j): ring order over node m's locals starting after j, then over nodes, N a power
    of two, the pairwise tree T_K(r) = y_r[(i, j)]; T_k(r) = T_{k+1}(r) + T_{k+1}(r XOR 2^k);
    result T_0(i); any other N, the dissemination tree S_K(r, q) = y_r[(r + q, j)];
    S_k(r, q) = S_{k+1}(r, q) + S_{k+1}(r - 2^k, q + 2^k) for q < min(2^k, N - 2^k); result
    S_0(i, 0)."""
    N, M = len(nodes), len(nodes[0])

    def chunk(rank, node, local):
        g = node * M + local
        return x[rank][g * c : (g + 1) * c]

    def y(m, node):
        return _ring_sum([chunk(nodes[m][l], node, j) for l in range(M)], j)

    K = math.ceil(math.log2(N)) if N > 1 else 0

    def T(k, r):
        return y(r, i) if k == K else T(k + 1, r) + T(k + 1, r ^ 2**k)

    if 2**K == N:
        return T(0, i)

    def S(k, r, q):
        if k == K:
            return y(r, (r + q) % N)
        if q < min(2**k, N - 2**k):
            return S(k + 1, r, q) + S(k + 1, (r - 2**k) % N, q + 2**k)
        return S(k + 1, r, q)

    return S(0, i, 0)


# ---- distributed checks -----------------------------------------------------------------------


def _exactness(topo_name, partition, dtype_name):
    import torch
    import torch.distributed as dist

    from ds_ext.comm.collectives import torch_op
    from ds_ext.perf import collectives as model

    dtype = getattr(torch, dtype_name)
    comm = _comm(topo_name)
    group = comm.registry.group(partition)
    ranks = comm.registry.ranks(group)
    rank, d = dist.get_rank(), len(ranks)
    me = ranks.index(rank)
    c, e = 5, torch.tensor([], dtype=dtype).element_size()
    shape = model.node_shape(comm.registry.topology, ranks)
    algos = ["ring", "auto"] + (["pccl"] if shape is not None else [])
    out = {"d": d, "shape": shape}

    x = _input(rank, c, dtype, 1)
    want = torch.empty(d * c, dtype=dtype)
    torch_op("all_gather_into_tensor")(want, x, group=group)
    big = {r: _input(r, d * c, dtype, 2) for r in ranks}
    nodes = [
        [r for r in ranks if r // comm.registry.topology.ranks_per_node == n]
        for n in sorted({r // comm.registry.topology.ranks_per_node for r in ranks})
    ]
    for algo in algos:
        chosen = comm.choose(group, c * e, algo)
        got = torch.empty(d * c, dtype=dtype)
        comm.all_gather(got, x, group=group, algorithm=algo)
        ag = comm.ledger.mark_step()
        red = torch.empty(c, dtype=dtype)
        comm.reduce_scatter(red, big[rank].clone(), group=group, algorithm=algo)
        rs = comm.ledger.mark_step()
        if chosen == "native":  # on gloo: each owner sums the chunks in group-rank order
            ref = big[ranks[0]][me * c : (me + 1) * c]
            for r in ranks[1:]:
                ref = ref + big[r][me * c : (me + 1) * c]
        elif chosen == "ring":
            ref = _ring_sum([big[r][me * c : (me + 1) * c] for r in ranks], me)
        else:
            i = next(k for k, n in enumerate(nodes) if rank in n)
            ref = _pccl_sum({r: big[r] for r in ranks}, nodes, i, nodes[i].index(rank), c)
        expect = model.traffic(chosen, comm.registry.topology, ranks, c * e)
        out[algo] = {
            "chosen": chosen,
            "all_gather_equal": torch.equal(got, want),
            "reduce_scatter_equal": torch.equal(red, ref),
            "ledger": [{lv: (s.by_level()[lv], s.messages_by_level()[lv]) for lv in s.by_level()} for s in (ag, rs)],
            "model": expect,
        }
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("topo,partition", CASES)
def test_exact_and_ledger_equals_model(world, topo, partition, dtype):
    results = world.run(_exactness, topo, partition, dtype)
    sizes = set()
    for r in results:
        sizes.add(r["d"])
        for algo in ("ring", "pccl", "auto"):
            if algo not in r:
                continue
            got = r[algo]
            assert got["all_gather_equal"], (algo, r["d"])
            assert got["reduce_scatter_equal"], (algo, r["d"])
            model = {lv: (float(b), m) for lv, (b, m) in got["model"].items()}
            assert got["ledger"] == [model, model], (algo, got)
        if r["d"] > 1:  # 20-byte chunks, latency-bound: auto runs pccl wherever it sends fewer messages
            N, M = r["shape"] or (1, r["d"])
            fewer = N > 1 and math.ceil(math.log2(N)) + M - 1 < r["d"] - 1
            assert r["auto"]["chosen"] == ("pccl" if r["shape"] and fewer else "native"), r
    assert sizes <= set(range(1, 9))


def _pccl_refuses_uneven_group():
    import torch

    from ds_ext.comm.algorithms import AlgorithmError

    comm = _comm("4x2")
    group = comm.registry.group(((0, 1, 2, 3, 4, 5, 6), (7,)))  # nodes of 2, 2, 2, 1 ranks
    ranks = comm.registry.ranks(group)
    if len(ranks) == 1:
        return None
    try:
        comm.all_gather(torch.empty(7), torch.ones(1), group=group, algorithm="pccl")
    except AlgorithmError as err:
        msg = str(err)
    auto = comm.choose(group, 4, "auto")
    try:
        comm.reduce_scatter(
            torch.empty(1), torch.ones(7), op=torch.distributed.ReduceOp.MAX, group=group, algorithm="ring"
        )
    except AlgorithmError as err:
        return msg, auto, str(err)


def test_pccl_refuses_uneven_group_and_other_reductions(world):
    for r in world.run(_pccl_refuses_uneven_group):
        if r is None:
            continue
        msg, auto, op_msg = r
        assert "ds_ext.comm.algorithm='pccl'" in msg and "allowed here: auto, ring, native" in msg
        assert "\n" not in msg
        assert auto == "native"
        assert "SUM reductions only" in op_msg and "allowed: auto, native" in op_msg


# ---- pure logic: the model against hand-worked numbers ----------------------------------------


def test_auto_needs_the_cost_model_passed_down():
    """comm sits below perf: a Communicator built without ``model`` (the runtime passes
    ``ds_ext.perf.collectives``) refuses ``auto`` in one line instead of importing the model."""
    from ds_ext.comm import Communicator
    from ds_ext.comm.algorithms import AlgorithmError
    from ds_ext.groups import GroupRegistry

    comm = Communicator(GroupRegistry(_topology("4x2")), algorithm="auto")
    with pytest.raises(AlgorithmError, match=r"need the algorithms' cost model.*model=ds_ext\.perf\.collectives"):
        comm.choose(None, 4, None)


def test_model_traffic_by_hand():
    from ds_ext.perf import collectives as model

    t = _topology("4x2")
    world = tuple(range(8))
    # ring over 8 ranks at the node level: 7 chunks in 7 messages
    assert model.traffic("ring", t, world, 100) == {"node": (700, 7)}
    # pccl 4 nodes x 2: recursive doubling sends 1 + 2 = 3 chunks in 2 messages, then the ring
    # inside the node one block of 4 chunks
    assert model.traffic("pccl", t, world, 100) == {"node": (300, 2), "local": (400, 1)}
    # 3 nodes x 2 (ranks 0-5): dissemination steps of 1 and 1 chunk
    assert model.traffic("pccl", t, (0, 1, 2, 3, 4, 5), 100) == {"node": (200, 2), "local": (300, 1)}
    t8 = _topology("8x1")
    assert model.traffic("pccl", t8, (0, 1, 2, 3, 4), 10) == {"node": (40, 3)}  # steps of 1, 2, 1 chunks
    assert model.traffic("pccl", t8, tuple(range(7)), 10) == {"node": (60, 3)}  # 1, 2, 3
    assert model.node_shape(t, (0, 1, 2, 3, 4, 5, 6)) is None
    t3 = _topology("2x4")
    assert model.traffic("pccl", t3, world, 8) == {"node": (8, 1), "gpu": (48, 3)}


def test_model_time_and_crossover():
    from dataclasses import replace

    from ds_ext.perf import collectives as model
    from ds_ext.topology import GB, US, Topology

    t = _topology("4x2")
    world = tuple(range(8))
    # ring: 7 (15 us + c / min(50, 2 x 12.5) GB/s); pccl: 2 x 15 us + 3c / 12.5 + 8 us + 4c / 50
    c = 1e6
    assert model.time("ring", t, world, c) == pytest.approx(7 * (15 * US + c / (25 * GB)))
    assert model.time("pccl", t, world, c) == pytest.approx(30 * US + 3 * c / (12.5 * GB) + 8 * US + 4 * c / (50 * GB))
    star = model.crossover(t, world)
    # (105 - 38) us = c* (3/12.5 + 4/50 - 7/25) / GB
    assert star == pytest.approx(67 * US * GB / 0.04)
    assert model.choose(t, world, star / 2) == "pccl" and model.choose(t, world, star * 2) == "native"
    assert model.choose(t, (0, 1), 4) == "native"  # inside one node a ring is all pccl has
    # one rank per node: same bytes, fewer messages, pccl never slower
    assert model.crossover(_topology("8x1"), world) is None
    # a measured node link: 2 ranks at once get 9 GB/s each, one flow alone 24 GB/s: the ring's
    # one flow per node moves at 24, pccl's node phase at 9
    measured = Topology(
        tuple(replace(lv, bandwidth=9 * GB, link_bandwidth=24 * GB) if lv.name == "node" else lv for lv in t.levels),
        "measured",
    )
    assert model.time("ring", measured, world, c) == pytest.approx(7 * (15 * US + c / (24 * GB)))
    assert model.time("pccl", measured, world, c) == pytest.approx(
        30 * US + 3 * c / (9 * GB) + 8 * US + 4 * c / (50 * GB)
    )


def test_dissemination_steps_any_count():
    from ds_ext.comm.algorithms import dissemination_steps

    for n in range(1, 40):
        steps = dissemination_steps(n)
        assert len(steps) == (math.ceil(math.log2(n)) if n > 1 else 0)
        assert sum(m for _, m in steps) == n - 1
        assert [dk for dk, _ in steps] == [2**k for k in range(len(steps))]


def test_config_key_and_error():
    from ds_ext import config as cfgmod

    assert cfgmod.parse({}).comm.algorithm == "native"
    assert cfgmod.parse({"comm": {"algorithm": "pccl"}}).comm.algorithm == "pccl"
    with pytest.raises(cfgmod.DsExtConfigError, match=r"ds_ext\.comm\.algorithm.*'auto', 'ring', 'pccl' or 'native'"):
        cfgmod.parse({"comm": {"algorithm": "tree"}})


# ---- DeepSpeed ZeRO-3's own collectives through PCCL ("ds_ext": {"pccl": {"enabled": true}}) ---

DS_TOPOLOGY = {
    "levels": [
        {"name": "local", "size": 2, "bandwidth_GBps": 50, "latency_us": 8},
        {"name": "node", "bandwidth_GBps": 12.5, "latency_us": 15},
    ],
    "emulate": True,
}


def _zero3(pccl, steps=3):
    import torch
    import torch.distributed as dist

    import ds_ext
    from ds_ext.models import GPT, GPTConfig

    torch.manual_seed(7)
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=2))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    block = {"topology": DS_TOPOLOGY, **({"pccl": {"enabled": True}} if pccl else {})}
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10_000,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "ds_ext": block,
    }
    engine, *_ = ds_ext.initialize(model=model, optimizer=opt, config=cfg)
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + dist.get_rank())
        tokens = torch.randint(0, 64, (2, 17), generator=g)
        loss = engine(tokens)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    ledger = engine.ds_ext.ledger
    out = {"losses": losses}
    for op in ("all_gather", "reduce_scatter"):
        total = {"bytes": {}, "messages": {}, "calls": {}}
        for s in ledger.steps:
            for (_, o, lv), b in s.bytes.items():
                if o == op:
                    total["bytes"][lv] = total["bytes"].get(lv, 0) + b
                    total["messages"][lv] = total["messages"].get(lv, 0) + s.messages[(_, o, lv)]
                    total["calls"][lv] = total["calls"].get(lv, 0) + s.calls[(_, o, lv)]
        out[op] = total
    engine.destroy()
    return out


def test_deepspeed_zero3_through_pccl(world):
    from ds_ext.perf import collectives as model

    native = world.run(_zero3, False)
    pccl = world.run(_zero3, True)
    topo = _topology("4x2")
    # per unit of chunk: pccl on 4 nodes x 2 sends 3 chunks in 2 messages across nodes, 4 in 1 inside
    unit = model.traffic("pccl", topo, tuple(range(8)), 1.0)
    for a, b in zip(native, pccl):
        # bit-identical all-gathers; reduce-scatters differ from gloo's only in the summation order
        assert a["losses"][0] == b["losses"][0]
        assert all(math.isclose(x, y, rel_tol=1e-5) for x, y in zip(a["losses"], b["losses"])), (a, b)
        for op in ("all_gather", "reduce_scatter"):
            ring, hier = a[op], b[op]
            assert set(ring["bytes"]) == {"node"}  # ZeRO-3's collectives span the 8-rank world
            calls, chunk_sum = ring["calls"]["node"], ring["bytes"]["node"] / 7
            assert ring["messages"] == {"node": 7 * calls}
            assert sum(hier["bytes"].values()) == pytest.approx(ring["bytes"]["node"])  # same bytes in total
            assert hier["bytes"] == pytest.approx({lv: b * chunk_sum for lv, (b, _) in unit.items()})
            assert hier["messages"] == {lv: m * calls for lv, (_, m) in unit.items()}


def _deepspeed_moe(pccl, steps=3):
    """DeepSpeed-MoE (4 experts over expert groups of 2) under DeepSpeed ZeRO-2 with clipping, with
    the pccl plugin or without: losses, this rank's parameters, the step's all-gather levels."""
    import torch
    import torch.distributed as dist

    import ds_ext
    from ds_ext.bench.tiled import batch, moe_model, moe_param_groups

    model = moe_model(16, 32, 4, 2)
    opt = torch.optim.AdamW(moe_param_groups(model), lr=1e-2)
    cfg = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10_000,
        "gradient_clipping": 0.05,
        "zero_optimization": {"stage": 2},
        "ds_ext": {"topology": DS_TOPOLOGY, **({"pccl": {"enabled": True}} if pccl else {})},
    }
    engine, *_ = ds_ext.initialize(model=model, optimizer=opt, config=cfg)
    losses = []
    for step in range(steps):
        loss = engine(*batch(step, 16, 8, torch.float32))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    levels = sorted({lv for (ph, op, lv) in engine.ds_ext.ledger.steps[-1].bytes if (ph, op) == ("step", "all_gather")})
    engine.destroy()
    dist.barrier()
    return losses, params, levels


def test_deepspeed_moe_through_pccl(world):
    """PCCL under DeepSpeed-MoE: ZeRO-2's partition all-gathers over the data group (4 nodes x 2) and
    the experts' expert-data group (one rank on each node) run by PCCL; losses and every parameter
    equal DeepSpeed's native collectives within float reordering."""
    import torch

    native = world.run(_deepspeed_moe, False)
    pccl = world.run(_deepspeed_moe, True)
    for (losses, params, levels), (p_losses, p_params, p_levels) in zip(native, pccl):
        assert p_losses == pytest.approx(losses, rel=1e-5, abs=0) and losses[-1] != losses[0]
        assert any("deepspeed_experts" in name for name in params)
        for name, p in params.items():
            torch.testing.assert_close(p_params[name], p, rtol=1e-5, atol=1e-6, msg=name)
        assert levels == ["node"] and p_levels == ["local", "node"]  # the ring inside each node ran too


# ---- ds_ext's zero3 / zeropp presets with comm.algorithm: the ledger == ds_ext.zero_topo.perf ------


def _preset_ledger(preset, algorithm):
    import torch
    import torch.distributed as dist

    import ds_ext
    from ds_ext.models import GPT, GPTConfig

    torch.manual_seed(7)
    model = GPT(GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=2, n_heads=2))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10_000,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 0},
        "ds_ext": {
            "topology": {"preset": "frontier", "sizes": {"gpu": 2}, "emulate": True},
            "comm": {"algorithm": algorithm},
            "zero_topo": {"enabled": True, "preset": preset},
        },
    }
    engine, *_ = ds_ext.initialize(model=model, optimizer=opt, config=cfg)
    for step in range(2):
        tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(100 * step + dist.get_rank()))
        engine.backward(engine(tokens))
        engine.step()
    last = engine.ds_ext.ledger.steps[-1]
    model_traffic = engine.ds_ext.plugins[0].analytic_traffic(1)
    out = {
        "bytes": {ph: dict(v) for ph, v in last.by_phase().items() if ph != "other"},
        "calls": last.calls_by_level(),
        "messages": last.messages_by_level(),
        "model_bytes": model_traffic.bytes,
        "model_calls": model_traffic.calls_by_level(),
        "model_messages": model_traffic.steps_by_level(),
    }
    engine.destroy()
    return out


@pytest.mark.parametrize("preset,algorithm", [("zero3", "pccl"), ("zeropp", "pccl"), ("zero_topo_paper", "pccl")])
def test_presets_ledger_equals_model(world, preset, algorithm):
    for r in world.run(_preset_ledger, preset, algorithm):
        assert r["bytes"] == r["model_bytes"]
        assert r["calls"] == r["model_calls"]
        assert r["messages"] == r["model_messages"]
        if algorithm == "pccl":  # the world-level collectives really ran in two phases
            assert r["messages"]["node"] < r["calls"]["node"] * 7


def test_bench_helpers(tmp_path):
    from ds_ext.bench.pccl import _crossover, _resolution, _size
    from ds_ext.cli import build_parser

    assert (_size("4K"), _size("64M"), _size("4096"), _size("1mb")) == (4096, 64 << 20, 4096, 1 << 20)
    rows = [
        {"size": s, "speedup_pccl_over_ring": v, "tie_band": 0.05}
        for s, v in [(1, 2.0), (2, 0.9), (4, 1.1), (8, 0.8), (16, 0.7)]
    ]
    assert _crossover(rows) == 8  # ring ahead from 8 on; the dip at 2 is not a crossover
    assert _crossover([{"size": 1, "speedup_pccl_over_ring": 1.5, "tie_band": 0.0}]) is None
    ties = [dict(r, speedup_pccl_over_ring=v) for r, v in zip(rows, (2.0, 0.9, 0.8, 0.97, 0.96))]
    assert _crossover(ties) is None  # within the tie band at the largest sizes: a tie, not a crossover
    assert _crossover(ties, band=None) == 2  # without a band any margin counts
    assert _resolution([3.0, 2.0, 2.2]) == pytest.approx(0.1)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "pccl", "--out", "x.json", "--repeats", "1"])

    from ds_ext.bench.pccl import run
    from ds_ext.cluster.spec import ClusterError

    ns = build_parser().parse_args(["bench", "pccl", "--out", str(tmp_path / "unused.json"), "--gpu-rate", "1mbit"])
    with pytest.raises(ClusterError, match="--gpu-rate only apply to --network netns"):
        run(ns)  # refused before any rank starts: the emulated links would silently replace it


_KEEP_FREED_PROBE = """
import torch
from ds_ext.bench.pccl import keep_freed_memory

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096

setting = keep_freed_memory() if KEEP else "default"
before = rss()
t = torch.ones(16 << 20)  # 64 MB, touched
del t
print(setting, (rss() - before) >> 20)
"""


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads the resident size from /proc")
def test_bench_keeps_freed_memory_like_a_caching_allocator():
    """The bench's ranks keep what they free (glibc): a freed 64 MB tensor stays resident for the
    next call's temporaries; by default glibc unmaps it, and the next call touches fresh pages."""
    from ds_ext.bench.pccl import KEEP_FREED

    def probe(keep):
        out = subprocess.run(
            [sys.executable, "-c", f"KEEP = {keep}" + _KEEP_FREED_PROBE],
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        ).stdout.split()
        return " ".join(out[:-1]), int(out[-1])

    setting, kept_mb = probe(False)
    assert setting == "default" and kept_mb < 8  # unmapped on free
    setting, kept_mb = probe(True)
    assert setting == KEEP_FREED and kept_mb >= 63


# ---- 3D-PMM with its Z axis across nodes: serial-model parity, ledger == ds_ext.perf.pmm --------


def _pmm_z_across_nodes(algorithm):
    import pmm_helpers as H

    from ds_ext.perf.pmm import ledger_bytes, ledger_messages
    from ds_ext.pmm.plans import plan_for
    from ds_ext.pmm.spec import model_spec

    grid = (1, 2, 4, 1)  # Z groups {0, 2, 4, 6}, {1, 3, 5, 7}: 2 nodes x 2 ranks
    cfg = H.ds_config(grid)
    cfg["ds_ext"]["comm"] = {"algorithm": algorithm}
    engine = H.engine_for("gpt", cfg)
    serial, _ = H.serial_run("gpt")
    data_rows, _ = H._rows(engine)
    losses = []
    for step in range(2):
        loss, _ = H.call(engine, "gpt", H.tokens(step)[data_rows])
        engine.backward(loss)
        engine.step()
        losses.append((loss.item(), serial[step]["loss"]))
    last = engine.ds_ext.ledger.steps[-1]
    messages = {}
    for (ph, _, lv), m in last.messages.items():
        if ph != "step":
            messages.setdefault(ph, {}).setdefault(lv, 0)
            messages[ph][lv] += m
    spec, plugin = model_spec(H.gpt(), plan_for(H.gpt())), engine.ds_ext.plugin("pmm3d")
    args = (spec, plugin.grid, engine.ds_ext.topology, H.GLOBAL_BATCH, H.SEQ, 4, 1, False, algorithm)
    out = {
        "losses": losses,
        "bytes": {ph: lv for ph, lv in last.by_phase().items() if ph != "step"},
        "messages": messages,
        "model_bytes": ledger_bytes(*args),
        "model_messages": ledger_messages(*args),
        "z_levels": sorted({lv for (_, op, lv) in last.bytes if op in ("all_gather", "reduce_scatter")}),
    }
    engine.destroy()
    return out


def test_pmm_z_axis_across_nodes(world):
    # auto: Z (across nodes, 16-128 byte chunks) by pccl, Y (inside a GCD pair) native
    for r in world.run(_pmm_z_across_nodes, "auto"):
        for got, want in r["losses"]:
            assert got == pytest.approx(want, rel=1e-4)  # the serial model (fp32 tolerance of test_pmm_*)
        assert r["bytes"] == r["model_bytes"]
        assert r["messages"] == r["model_messages"]
        assert r["z_levels"] == ["gpu", "node"]  # Z's all-gathers / reduce-scatters ran in two phases


def _emulated_hold():
    import time

    import torch

    from ds_ext.comm import Communicator, TimeEmulator
    from ds_ext.perf import collectives as model

    comm = _comm("4x2")
    timed = Communicator(comm.registry, emulator=TimeEmulator(comm.registry.topology, scale=2000.0), model=model)
    world = tuple(range(8))
    out = {}
    for algo in ("ring", "pccl"):
        t0 = time.perf_counter()
        timed.all_gather(torch.empty(8 * 1000), torch.ones(1000), algorithm=algo)
        out[algo] = (time.perf_counter() - t0, 2000.0 * model.time(algo, comm.registry.topology, world, 4000))
    return out


def test_time_emulation_holds_the_modelled_time(world):
    for r in world.run(_emulated_hold):
        for held, predicted in r.values():
            assert predicted > 0.05 and held >= predicted
        assert r["ring"][1] > r["pccl"][1]
