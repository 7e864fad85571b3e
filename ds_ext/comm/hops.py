"""Where a collective's bytes travel: the peers this rank sends to, and how much to each.

The ledger's byte convention (:mod:`ds_ext.comm.ledger`, 003 §V-D) books a collective's volume
at the outermost level its group spans. A ring over 8 ranks on 2 nodes crosses the NICs on 2 of
its 8 hops, so that convention books 4x what the NICs carry. The *link bytes* the ledger keeps
beside it follow the algorithm the backend runs: each byte this rank sends is booked at the level
of the link to its peer (``Topology.level_of`` of the pair), so that, summed over the ranks, each
level's link bytes are what that level's links carry (``ds_ext.cluster.wire``: the kernel's
counters of every shaped link).

What gloo runs (torch 2.13, measured on ``ds-ext cluster`` with a NIC per GPU, one collective of
S bytes per rank over d ranks; ``tests/test_cluster_nic.py``)::

    all_gather       ring, to group rank g + 1             S (d - 1)
    all_reduce       ring, to group rank g - 1             2 S (d - 1) / d
    reduce_scatter   (gloo's own) an all-reduce of the input: 2 S (d - 1) / d to g - 1
                     (ds_ext runs it as an all_to_all: ``Communicator.reduce_scatter``)
    reduce           ring reduce-scatter to g - 1, S (d - 1) / d, then the rank's reduced
                     chunk S / d straight to the root
    broadcast        binomial tree from the root: in the round of mask m = 1, 2, 4, ...
                     relative rank r < m sends S to relative rank r + m
    all_to_all       straight to each peer, its split

NCCL / RCCL choose their own algorithm and ring order from the hardware they detect. The ledger
assumes their ring in group-rank order (each rank to g + 1: all_gather S (d - 1),
reduce_scatter S (d - 1)/d, all_reduce 2 S (d - 1)/d), a ring chain from the root for broadcast
and reduce, and direct sends for all_to_all. This can differ where the library picks a tree
(all_reduce at scale), another ring order than the ranks' (it orders a ring to cross each node
boundary once; Megatron / DeepSpeed number ranks node by node, so a group-order ring over a
node-major group crosses the same number of node boundaries), or NVLS / CollNet.

ds_ext's own algorithms (ring, PCCL: :mod:`ds_ext.comm.algorithms`) send point to point; their
peers are counted send by send.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Mapping, Sequence

from ds_ext.errors import DsExtError
from ds_ext.topology import Topology

Sends = dict[int, float]  # global rank of the peer -> bytes this rank sends it


class LinkModelError(DsExtError, ValueError):
    """A call :func:`sends` has no link model for, or lacks what its model needs."""


def _ring(ranks: Sequence[int], me: int, nbytes: float, step: int) -> Sends:
    d = len(ranks)
    if d < 2 or nbytes == 0:
        return {}
    return {ranks[(ranks.index(me) + step) % d]: float(nbytes)}


def _tree_broadcast(ranks: Sequence[int], me: int, root: int, nbytes: float) -> Sends:
    """gloo's binomial tree from ``root``: relative rank r sends to r + m for every mask m > r."""
    d, g, r0 = len(ranks), ranks.index(me), ranks.index(root)
    rel = (g - r0) % d
    out: Sends = {}
    m = 1
    while m < d:
        if rel < m and rel + m < d:
            out[ranks[(rel + m + r0) % d]] = float(nbytes)
        m *= 2
    return out


def _chain(ranks: Sequence[int], me: int, root: int, nbytes: float, to_root: bool) -> Sends:
    """A ring pipeline over group ranks in order: from ``root`` (broadcast: every rank but the one
    before the root forwards S to g + 1) or towards it (reduce: every rank but the root sends S)."""
    d, g, r0 = len(ranks), ranks.index(me), ranks.index(root)
    last = (r0 - 1) % d
    sends = g != r0 if to_root else g != last
    return {ranks[(g + 1) % d]: float(nbytes)} if sends and d > 1 else {}


def sends(
    op: str,
    ranks: Sequence[int],
    me: int,
    payload: float,
    gloo: bool,
    root: int | None = None,
    per_peer: Sequence[float] | None = None,
) -> Sends:
    """The bytes this rank (global ``me``) sends to each peer in one ``op`` over the group of
    global ``ranks`` (in group-rank order), run by gloo (``gloo``) or by NCCL / RCCL (module
    docstring). ``payload``: the input bytes of all_gather / reduce_scatter, the tensor bytes of
    all_reduce / reduce / broadcast; ``root``: broadcast's source or reduce's destination (global);
    ``per_peer``: the bytes for each group rank where the call sends straight to each (all_to_all,
    and ds_ext's reduce_scatter on gloo, an all_to_all of the chunks; this rank's own ignored)."""
    d = len(ranks)
    if d < 2:
        return {}
    if per_peer is not None:
        return {r: float(b) for r, b in zip(ranks, per_peer, strict=True) if r != me and b}
    if op == "all_gather":
        return _ring(ranks, me, payload * (d - 1), 1)
    if op == "all_reduce":
        return _ring(ranks, me, 2 * payload * (d - 1) / d, -1 if gloo else 1)
    if op == "reduce_scatter":
        return _ring(ranks, me, 2 * payload * (d - 1) / d, -1) if gloo else _ring(ranks, me, payload * (d - 1) / d, 1)
    if op == "all_to_all":
        raise LinkModelError("all_to_all needs per_peer")
    if root is None:
        raise LinkModelError(f"{op} needs its root")
    if op == "broadcast":
        return _tree_broadcast(ranks, me, root, payload) if gloo else _chain(ranks, me, root, payload, False)
    if op == "reduce":
        if not gloo:
            return _chain(ranks, me, root, payload, True)
        out = _ring(ranks, me, payload * (d - 1) / d, -1)
        if me != root:
            out[root] = out.get(root, 0.0) + payload / d
        return out
    raise LinkModelError(f"no link model for {op!r}")


def by_level(topology: Topology, me: int, peers: Mapping[int, float]) -> dict[str, float]:
    """``peers`` (bytes per peer) summed per the level of the link from ``me`` to each peer."""
    out: dict[str, float] = defaultdict(float)
    for peer, nbytes in peers.items():
        level = topology.level_of((me, peer))
        if level is not None and nbytes:
            out[level] += nbytes
    return dict(out)
