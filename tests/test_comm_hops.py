"""Link bytes (``ds_ext.comm.hops``): the peers each rank sends to under each backend's algorithm,
against tables written out by hand for small groups (the wire itself: tests/test_cluster_nic.py)."""

import pytest

from ds_ext.comm import hops
from ds_ext.topology import Topology

S = 1200.0  # payload bytes per rank
RANKS = (0, 1, 2, 3)


def _all(op, gloo, **kw):
    return {me: hops.sends(op, RANKS, me, S, gloo, **kw) for me in RANKS}


def test_rings_of_each_backend():
    # gloo's all_gather and NCCL's rings go to the next group rank, gloo's all-reduce to the previous
    assert _all("all_gather", True) == {0: {1: 3 * S}, 1: {2: 3 * S}, 2: {3: 3 * S}, 3: {0: 3 * S}}
    assert _all("all_reduce", True) == {0: {3: 1.5 * S}, 1: {0: 1.5 * S}, 2: {1: 1.5 * S}, 3: {2: 1.5 * S}}
    assert _all("all_reduce", False) == {0: {1: 1.5 * S}, 1: {2: 1.5 * S}, 2: {3: 1.5 * S}, 3: {0: 1.5 * S}}
    # gloo's own reduce-scatter is an all-reduce of the input (twice NCCL's bytes)
    assert _all("reduce_scatter", True) == _all("all_reduce", True)
    assert _all("reduce_scatter", False) == {0: {1: 0.75 * S}, 1: {2: 0.75 * S}, 2: {3: 0.75 * S}, 3: {0: 0.75 * S}}


def test_broadcast_and_reduce():
    # gloo: a binomial tree from the root (relative rank r sends to r + 1, r + 2, ... while < d)
    assert _all("broadcast", True, root=0) == {0: {1: S, 2: S}, 1: {3: S}, 2: {}, 3: {}}
    assert _all("broadcast", True, root=1) == {0: {}, 1: {2: S, 3: S}, 2: {0: S}, 3: {}}
    # NCCL: a chain from the root in group-rank order
    assert _all("broadcast", False, root=1) == {0: {}, 1: {2: S}, 2: {3: S}, 3: {0: S}}
    # gloo's reduce: a ring reduce-scatter to the previous rank, then each chunk straight to the root
    assert _all("reduce", True, root=0) == {
        0: {3: 0.75 * S},
        1: {0: 0.75 * S + 0.25 * S},
        2: {1: 0.75 * S, 0: 0.25 * S},
        3: {2: 0.75 * S, 0: 0.25 * S},
    }
    assert _all("reduce", False, root=2) == {0: {1: S}, 1: {2: S}, 2: {}, 3: {0: S}}


def test_direct_sends_and_groups():
    assert hops.sends("all_to_all", RANKS, 2, 0.0, True, per_peer=[1, 2, 3, 4]) == {0: 1, 1: 2, 3: 4}
    # a group in its own rank order, over global ranks
    assert hops.sends("all_gather", (4, 6), 6, S, False) == {4: S}
    assert hops.sends("all_reduce", (5,), 5, S, True) == {}
    with pytest.raises(ValueError, match="needs its root"):
        hops.sends("broadcast", RANKS, 0, S, True)


def test_by_level_books_each_peer_at_its_link():
    topo = Topology.from_preset("frontier", 16)  # gcd 2 x gpu 4 x node 2
    # rank 1: 0 is its GCD partner, 2 another GPU of its node, 9 on the other node
    assert hops.by_level(topo, 1, {0: 10, 2: 20, 9: 30, 8: 5}) == {"gcd": 10, "gpu": 20, "node": 35}
    # a ring over the world in rank order: 2 of its 16 hops cross the nodes, 6 the GPUs, 8 the GCD pairs
    ranks = tuple(range(16))
    levels = [hops.by_level(topo, r, hops.sends("all_gather", ranks, r, S, True)) for r in ranks]
    assert sum(lv.get("node", 0) for lv in levels) == 2 * 15 * S
    assert sum(lv.get("gpu", 0) for lv in levels) == 6 * 15 * S
    assert sum(lv.get("gcd", 0) for lv in levels) == 8 * 15 * S
