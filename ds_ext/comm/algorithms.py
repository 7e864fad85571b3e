"""All-gather and reduce-scatter algorithms on torch.distributed point-to-point (001 §6.2).

Notation (001 §6.2.1, Fig 6.5): a group of W = N x M ranks, N nodes of M ranks each; group
ranks are node-major (group rank g = i M + j for node i, local index j), since torch orders a
group by global rank and ranks are numbered node-major; c elements per chunk (one rank's
all-gather input, or its reduce-scatter output). The *node sub-communicator* of local index
j holds the N ranks (i, j), i = 0..N-1 (001's inter-node sub-communicators).

``ring``   the flat ring NCCL / RCCL run over all W ranks: W - 1 steps, one chunk per step.
``pccl``   001 §6.2.1. All-gather: (1) all-gather inside every node sub-communicator, all M
           of them at once, by recursive doubling; (2) ring all-gather inside each node of the
           N-chunk blocks; (3) local shuffle (M, N, c) -> (N, M, c). Reduce-scatter is its
           transpose: shuffle (N, M, c) -> (M, N, c), ring reduce-scatter inside each node,
           then recursive halving inside every node sub-communicator.
           For N a power of two, pairwise recursive doubling / halving (001 §6.2.3, [60]):
           step k exchanges 2^k chunks with rank r XOR 2^k, in place in the output, no copy.
           For any other N, Bruck's dissemination form (Bruck et al. 1997, MPICH's all-gather
           for a non-power-of-two count): step k moves m_k = min(2^k, N - 2^k) chunks between
           ranks 2^k apart, through a work buffer rotated by r (one more copy of the N chunks).
           Both: K = ceil(log2 N) steps and N - 1 chunks sent per rank, m_k at step k.
``native`` torch.distributed's own collective (the backend picks its algorithm).
``auto``   pccl where ``ds_ext.perf.collectives`` predicts it faster than a ring, else native
           (torch's collective: NCCL / RCCL run a ring, and 001 §6.2.2 leaves the node's ranks to
           the vendor library), so a group inside one node stays native.

Summation order of reduce-scatter (IEEE addition is commutative, not associative, so the
parenthesization is the order). Indices of ranks are taken modulo the ring / node count.

* ring, block b of d ranks: ``(((x_{b+1} + x_{b+2}) + x_{b+3}) + ... + x_{b+d-1}) + x_b``.
* pccl, block (i, j): first per node m the ring order over its local indices,
  ``y_m = ((x_{m,j+1} + x_{m,j+2}) + ...) + x_{m,j}``; then over nodes, N a power of two, the
  pairwise order ``T_K(r) = y_r[block (i, j)]``, ``T_k(r) = T_{k+1}(r) + T_{k+1}(r XOR 2^k)``
  for k = K-1 down to 0, the result ``T_0(i)`` (node k of either tree adds the partial sums of
  the same two residue classes of ranks mod 2^(k+1), so the pairwise and dissemination orders
  give the same bits); any other N, the dissemination order
  ``S_K(r, q) = y_r[block (r + q, j)]`` and, for k = K-1 down to 0,
  ``S_k(r, q) = S_{k+1}(r, q) + S_{k+1}(r - 2^k, q + 2^k)`` for q < m_k (else unchanged);
  the result is ``S_0(i, 0)``.

Only SUM reductions, contiguous tensors. The p2p algorithms complete before returning (an
``async_op`` handle is already done, apart from emulated time). The ledger records each phase at
the level of the sub-group it runs on, with the bytes and messages this rank actually sent.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from ds_ext.errors import DsExtError
from ds_ext.topology import Topology

ALGORITHMS: tuple[str, ...] = ("auto", "ring", "pccl", "native")
P2P_ALGORITHMS: tuple[str, ...] = ("ring", "pccl")


class AlgorithmError(DsExtError, ValueError):
    """An algorithm that cannot run on the given group or operation."""


@dataclass(frozen=True)
class Hierarchy:
    """A group's global ranks as N nodes x M ranks, node-major (001 Fig 6.5)."""

    nodes: tuple[tuple[int, ...], ...]

    @property
    def N(self) -> int:
        return len(self.nodes)

    @property
    def M(self) -> int:
        return len(self.nodes[0])

    def position(self, rank: int) -> tuple[int, int]:
        """(node index i, local index j) of global ``rank``."""
        for i, node in enumerate(self.nodes):
            if rank in node:
                return i, node.index(rank)
        raise AlgorithmError(f"rank {rank} is not in the group")

    def node_comm(self, j: int) -> tuple[int, ...]:
        """The node sub-communicator of local index ``j``: (0, j), (1, j), ..., (N-1, j)."""
        return tuple(node[j] for node in self.nodes)


def hierarchy(topology: Topology, ranks: tuple[int, ...]) -> Hierarchy | None:
    """``ranks`` split by node, or None if the nodes hold different numbers of them."""
    per_node = topology.ranks_per_node
    by_node: dict[int, list[int]] = defaultdict(list)
    for r in sorted(ranks):
        by_node[r // per_node].append(r)
    nodes = tuple(tuple(by_node[n]) for n in sorted(by_node))
    if len({len(n) for n in nodes}) != 1:
        return None
    return Hierarchy(nodes)


def require_hierarchy(topology: Topology, ranks: tuple[int, ...]) -> Hierarchy:
    """:func:`hierarchy`, or the one-line error naming the config key."""
    h = hierarchy(topology, ranks)
    if h is None:
        per_node = {r // topology.ranks_per_node for r in ranks}
        raise AlgorithmError(
            f"ds_ext.comm.algorithm='pccl' needs the same number of ranks on every node of the group; ranks "
            f"{list(ranks)} spread unevenly over nodes {sorted(per_node)}; allowed here: auto, ring, native"
        )
    return h


class Tally:
    """Bytes and messages this rank sent, per topology level, in one collective."""

    def __init__(self) -> None:
        self.bytes: dict[str, float] = defaultdict(float)
        self.messages: dict[str, int] = defaultdict(int)
        self.sends: dict[int, float] = defaultdict(float)  # per destination (global rank): link bytes


# exchange(send, dst, recv, src, then=None): one step; ``then`` = (into, src) of the next step's
# receive, posted before this step is waited on (see p2p_exchange)
Exchange = Callable[..., None]
Then = tuple[torch.Tensor, int] | None


def p2p_exchange(
    group: object | None, tally: Tally, level: str | None, downward: object | None = None, posted: list | None = None
) -> Exchange:
    """send(t, dst) and recv(into, src) at once over ``group`` (global ranks), counted in ``tally``.

    Both directions of a pair run at once (full duplex, as the model assumes), also where a step
    exchanges with one peer both ways (every pairwise recursive doubling / halving step, a ring
    of 2):

    * ``downward`` given (gloo): a second group holding every rank of ``group`` (its own
      connections, :meth:`ds_ext.groups.GroupRegistry.p2p_downward`) carries the messages to a
      lower rank, ``group`` those to a higher one. Gloo
      moves a pair's two directions over its one connection one after the other, so an
      exchange with one peer would cost up to a one-way send of each direction in turn; with
      the second group it costs what an exchange with two different peers costs.
      With ``then`` (the next step's receive buffer and source) that receive is posted before
      this step is waited on. A gloo receive is a rendezvous: the sender transmits once the
      receiver has said it is ready, so a receive posted only after the previous step finished
      would leave each step waiting for that notice and for the receiving process to run.
      The measurements behind both choices: docs/benchmarks/network.md.
    * otherwise one ``batch_isend_irecv``: NCCL / RCCL run it as one group call, so two ranks
      that both send first cannot wait on each other; ``then`` is not posted early there (NCCL
      runs a communicator's operations in order, so an early receive would hold this rank's
      next send, and a ring would deadlock).

    ``posted``: the list that holds the receive posted early (one per exchange unless given);
    the phases of one collective share it, so a phase's last step posts the next phase's first
    receive.
    """
    me = dist.get_rank()
    early: list[tuple[torch.Tensor, int, object]] = [] if posted is None else posted  # the receive posted early

    def irecv(into: torch.Tensor, src: int) -> object:
        return dist.irecv(into, src, group=group if me > src else downward)

    def exchange(send: torch.Tensor, dst: int, recv: torch.Tensor, src: int, then: Then = None) -> None:
        if downward is None:
            works = dist.batch_isend_irecv(
                [dist.P2POp(dist.isend, send, dst, group), dist.P2POp(dist.irecv, recv, src, group)]
            )
        else:
            if early:
                into, from_, posted = early.pop()
                if (into.data_ptr(), into.numel(), from_) != (recv.data_ptr(), recv.numel(), src):
                    raise AlgorithmError("internal: a step received into another buffer than its predecessor posted")
            else:
                posted = irecv(recv, src)
            works = [dist.isend(send, dst, group=group if dst > me else downward), posted]
            if then is not None:
                early.append((then[0], then[1], irecv(*then)))
        for w in works:
            w.wait()  # type: ignore[attr-defined]
        tally.bytes[level] += send.numel() * send.element_size()  # type: ignore[index]
        tally.messages[level] += 1  # type: ignore[index]
        tally.sends[dst] += send.numel() * send.element_size()

    return exchange


# ---- ring (one ring over `ranks`, this rank at position g) --------------------------------


def ring_all_gather(blocks: torch.Tensor, ranks: tuple[int, ...], g: int, exchange: Exchange) -> None:
    """``blocks`` (d, c) holds this rank's block at row g; fill the others. Step s: send block
    g - s to g + 1, receive block g - s - 1 from g - 1."""
    d = len(ranks)
    right, left = ranks[(g + 1) % d], ranks[(g - 1) % d]
    for s in range(d - 1):
        then = (blocks[(g - s - 2) % d], left) if s + 2 < d else None
        exchange(blocks[(g - s) % d], right, blocks[(g - s - 1) % d], left, then)


def ring_reduce_scatter(
    blocks: torch.Tensor, out: torch.Tensor, ranks: tuple[int, ...], g: int, exchange: Exchange, then: Then = None
) -> None:
    """Sum of every rank's ``blocks`` (d, c) row g into ``out`` (c). Step s: send the partial sum
    of block g - s - 1 to g + 1, receive that of block g - s - 2 from g - 1 and add the own row.
    ``then``: the receive to post early in the last step (the next phase's first)."""
    d = len(ranks)
    if d == 1:
        out.copy_(blocks[0])
        return
    right, left = ranks[(g + 1) % d], ranks[(g - 1) % d]
    send = blocks[(g - 1) % d].clone()
    recvs = (torch.empty_like(send), torch.empty_like(send))  # alternate: the next step's is posted early
    for s in range(d - 1):
        exchange(send, right, recvs[s % 2], left, (recvs[(s + 1) % 2], left) if s + 2 < d else then)
        torch.add(recvs[s % 2], blocks[(g - s - 2) % d], out=send)
    out.copy_(send)


# ---- recursive doubling / halving, dissemination form (rank r of n in `ranks`) -------------


def dissemination_steps(n: int) -> list[tuple[int, int]]:
    """(distance 2^k, chunks m_k = min(2^k, n - 2^k)) for k = 0 .. ceil(log2 n) - 1."""
    return [(1 << k, min(1 << k, n - (1 << k))) for k in range(math.ceil(math.log2(n)) if n > 1 else 0)]


def _power_of_two(n: int) -> bool:
    return n & (n - 1) == 0


def recursive_doubling_all_gather(
    chunk: torch.Tensor, out: torch.Tensor, ranks: tuple[int, ...], r: int, exchange: Exchange, then: Then = None
) -> None:
    """``out`` (n, c) = every rank's ``chunk`` (c) in ``ranks`` order.

    n a power of two (pairwise): before step k this rank holds the rows of its aligned block of
    2^k, and swaps them with rank r XOR 2^k's block, in place. Otherwise (dissemination):
    position q of a work buffer holds rank r + q's chunk; step k sends positions [0, m_k) to
    r - 2^k and receives positions [2^k, 2^k + m_k) from r + 2^k; a final rotation puts chunk b
    in row b. ``then``: the receive to post early in the last step (the next phase's first)."""
    n = len(ranks)
    steps = dissemination_steps(n)
    if _power_of_two(n):
        out[r].copy_(chunk)

        def theirs(dist_k: int) -> tuple[torch.Tensor, int]:
            start = (r ^ dist_k) & ~(dist_k - 1)
            return out[start : start + dist_k], ranks[r ^ dist_k]

        for k, (dist_k, _) in enumerate(steps):
            mine = r & ~(dist_k - 1)
            exchange(
                out[mine : mine + dist_k],
                ranks[r ^ dist_k],
                *theirs(dist_k),
                theirs(steps[k + 1][0]) if k + 1 < len(steps) else then,
            )
        return
    work = torch.empty_like(out)
    work[0].copy_(chunk)
    for k, (dist_k, m) in enumerate(steps):
        following = then
        if k + 1 < len(steps):
            d2, m2 = steps[k + 1]
            following = (work[d2 : d2 + m2], ranks[(r + d2) % n])
        exchange(work[:m], ranks[(r - dist_k) % n], work[dist_k : dist_k + m], ranks[(r + dist_k) % n], following)
    out[r:].copy_(work[: n - r])  # the rotation, in one pass: row b is position b - r (mod n)
    out[:r].copy_(work[n - r :])


def halving_first(blocks: torch.Tensor, ranks: tuple[int, ...], r: int) -> tuple[torch.Tensor, Then]:
    """The buffer of recursive halving's first receive for ``blocks`` (n, c) (pairwise: n / 2
    rows; dissemination: the most rows a step receives), and that receive (the rows it fills,
    its source; None for one rank), made before the halving so that the previous phase can post
    it early."""
    n = len(ranks)
    if _power_of_two(n):
        first = blocks.new_empty((n // 2, *blocks.shape[1:]))
        return first, ((first, ranks[r ^ (n // 2)]) if n > 1 else None)
    steps = dissemination_steps(n)
    first = blocks.new_empty((max(m for _, m in steps), *blocks.shape[1:]))
    dist_k, m = steps[-1]
    return first, (first[:m], ranks[(r - dist_k) % n])


def recursive_halving_reduce_scatter(
    blocks: torch.Tensor,
    out: torch.Tensor,
    ranks: tuple[int, ...],
    r: int,
    exchange: Exchange,
    first: torch.Tensor | None = None,
) -> None:
    """``out`` (c) = sum over ``ranks`` of their ``blocks`` (n, c) row r: the transpose of
    :func:`recursive_doubling_all_gather`; ``blocks`` is not modified.

    n a power of two (pairwise): step k (largest first) sends the partial sums of the half of
    this rank's aligned block of 2^(k+1) that rank r XOR 2^k keeps, and adds the other half
    received from it to its own (own + received). Otherwise (dissemination): position q holds
    the partial sum of block r + q; step k (largest first) sends positions [2^k, 2^k + m_k) to
    r + 2^k and adds those received from r - 2^k into positions [0, m_k). ``first``: the first
    receive's buffer from :func:`halving_first` (made here if None)."""
    n = len(ranks)
    if first is None:
        first, _ = halving_first(blocks, ranks, r)
    if _power_of_two(n):
        _pairwise_halving(blocks, out, ranks, r, exchange, first)
        return
    work = torch.roll(blocks, shifts=-r, dims=0).contiguous()
    steps = list(reversed(dissemination_steps(n)))
    recvs = (first, torch.empty_like(first))  # alternate
    for i, (dist_k, m) in enumerate(steps):
        then = None
        if i + 1 < len(steps):
            d2, m2 = steps[i + 1]
            then = (recvs[(i + 1) % 2][:m2], ranks[(r - d2) % n])
        exchange(work[dist_k : dist_k + m], ranks[(r + dist_k) % n], recvs[i % 2][:m], ranks[(r - dist_k) % n], then)
        work[:m] += recvs[i % 2][:m]
    out.copy_(work[0])


def _pairwise_halving(
    blocks: torch.Tensor, out: torch.Tensor, ranks: tuple[int, ...], r: int, exchange: Exchange, first: torch.Tensor
) -> None:
    """Recursive halving for n = 2^K ranks. ``part`` holds the partial sums of the rows
    [base, base + 2^(k+1)) this rank is left with before step k: ``blocks`` itself before the
    first step; the first step's n / 2 rows are received into a buffer that then holds the
    partial sums, later steps receive alternately into buffers of n / 4 and n / 8 rows (the next
    step's receive is posted early) and add in place (7/8 of the input in all; the ring needs 3
    rows), and the last sum goes straight into ``out``."""
    n = len(ranks)
    if n == 1:
        out.copy_(blocks[0])
        return
    spare = (blocks.new_empty((n // 8, *blocks.shape[1:])), blocks.new_empty((n // 4, *blocks.shape[1:])))
    steps = [dist_k for dist_k, _ in reversed(dissemination_steps(n))]

    def receive(i: int) -> tuple[torch.Tensor, int]:
        return (first if i == 0 else spare[i % 2][: steps[i]]), ranks[r ^ steps[i]]

    part, base = blocks, 0
    for i, dist_k in enumerate(steps):
        mine, theirs = (r & ~(dist_k - 1)) - base, ((r ^ dist_k) & ~(dist_k - 1)) - base
        recv, peer = receive(i)
        exchange(part[theirs : theirs + dist_k], peer, recv, peer, receive(i + 1) if i + 1 < len(steps) else None)
        dest = out.view(1, *out.shape) if dist_k == 1 else recv if i == 0 else part[mine : mine + dist_k]
        torch.add(part[mine : mine + dist_k], recv, out=dest)
        part, base = dest, base + mine


# ---- the collectives -----------------------------------------------------------------------


def all_gather(
    algorithm: str,
    output: torch.Tensor,
    input: torch.Tensor,
    ranks: tuple[int, ...],
    me: int,
    topology: Topology,
    group: object | None,
    tally: Tally,
    downward: object | None = None,
) -> None:
    """``output`` (d c) = every group rank's ``input`` (c), by ``ring`` or ``pccl`` (flat tensors);
    ``downward``: see :func:`p2p_exchange`."""
    d, c = len(ranks), input.numel()
    if algorithm == "ring":
        blocks = output.view(d, c)
        g = ranks.index(me)
        blocks[g].copy_(input)
        ring_all_gather(blocks, ranks, g, p2p_exchange(group, tally, topology.level_of(ranks), downward))
        return
    h = require_hierarchy(topology, ranks)
    i, j = h.position(me)
    inter, posted = h.node_comm(j), []
    across_nodes = p2p_exchange(group, tally, topology.level_of(inter), downward, posted)
    if h.M == 1:  # no node phase, no shuffle: straight into the output
        recursive_doubling_all_gather(input, output.view(h.N, c), inter, i, across_nodes)
        return
    local = torch.empty(h.M, h.N * c, dtype=input.dtype, device=input.device)
    node = h.nodes[i]
    recursive_doubling_all_gather(
        input, local[j].view(h.N, c), inter, i, across_nodes, (local[(j - 1) % h.M], node[(j - 1) % h.M])
    )  # the ring's first receive
    ring_all_gather(local, node, j, p2p_exchange(group, tally, topology.level_of(node), downward, posted))
    output.view(h.N, h.M, c).copy_(local.view(h.M, h.N, c).transpose(0, 1))


def reduce_scatter(
    algorithm: str,
    output: torch.Tensor,
    input: torch.Tensor,
    ranks: tuple[int, ...],
    me: int,
    topology: Topology,
    group: object | None,
    tally: Tally,
    downward: object | None = None,
) -> None:
    """``output`` (c) = sum over the group of chunk ``me`` of ``input`` (d c), by ``ring`` or
    ``pccl`` in the summation order of the module docstring (flat tensors); ``downward``: see
    :func:`p2p_exchange`."""
    d, c = len(ranks), output.numel()
    if algorithm == "ring":
        g = ranks.index(me)
        ring_reduce_scatter(
            input.view(d, c), output, ranks, g, p2p_exchange(group, tally, topology.level_of(ranks), downward)
        )
        return
    h = require_hierarchy(topology, ranks)
    i, j = h.position(me)
    inter, posted = h.node_comm(j), []
    # M = 1: no shuffle, no node phase (a ring of one rank adds nothing)
    partial = input.view(h.N, c) if h.M == 1 else torch.empty(h.N, c, dtype=input.dtype, device=input.device)
    first, then = halving_first(partial, inter, i)
    if h.M > 1:
        by_local = input.view(h.N, h.M, c).transpose(0, 1).contiguous()  # (M, N, c)
        ring_reduce_scatter(
            by_local.view(h.M, h.N * c),
            partial.view(-1),
            h.nodes[i],
            j,
            p2p_exchange(group, tally, topology.level_of(h.nodes[i]), downward, posted),
            then,
        )
    recursive_halving_reduce_scatter(
        partial, output, inter, i, p2p_exchange(group, tally, topology.level_of(inter), downward, posted), first
    )
