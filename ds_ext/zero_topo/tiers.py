"""Two checkpoint tiers (``zero_topo.checkpoint_tiers``): node-local saves with a copy on a partner
node, the shared directory every few saves (multi-level checkpointing, as LLNL's SCR and Gemini,
SOSP'23, keep in-memory or node-local copies on peer machines).

Save k (the k-th ``save_checkpoint`` of the process) goes to the local tier when k is a multiple of
``local_every`` and to the shared directory (``save_dir``, the atomic protocol of
:mod:`ds_ext.zero_topo.checkpoint`) when k is a multiple of ``shared_every``, itself a multiple of
``local_every``: a shared save is a local one too, so the local tier always holds the newest save.

**Local save** of tag T, node n (directory L_n = ``local_dir`` with ``{node}`` replaced by n): every
rank writes its files (its ZeRO-topo shards and the files DeepSpeed writes on it) into
``L_n/.T.partial`` and sends them, as raw bytes, to its partner: the rank at its place on node
(n + 1) mod N, which writes them into its own node's staging directory; the ranks agree; the first
rank of each node writes the manifest (every file of the save and the rank that wrote it), renames
the staging directory to T and writes ``latest``; the ranks agree again. A crash before that leaves
each node's ``latest`` at its previous complete save.

**Load** (``load_checkpoint`` of the shared directory): the ranks all-gather each node's newest local
save and the files of it the node holds (present, CRC-checked); the newest save whose every file
has a copy on some node is loaded from the local tier: each node first fetches DeepSpeed's files
and the manifest it lacks, then, round by round, every ZeRO-topo shard its ranks' load asks for and
its node lacks (a lost node's shards come from its partner's copies, the rest from its own
directory), each from the first node holding it. A local save with a file on no node falls back to
the newest shared save, with one line saying so.

Every collective of the tiers (agreements, transfers) runs on a gloo group of their own
(:func:`ds_ext.zero_topo.async_save.agreement_group`), so that with ``async_save`` the save's part
after the snapshot runs in the background writer (:mod:`ds_ext.zero_topo.async_save`) beside training:
host bytes, not training traffic, so the ledger does not count them.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ds_ext.topology import Topology
from ds_ext.zero_topo import checkpoint as ckpt

MANIFEST = "ds_ext_tiers.json"
SHARD_PREFIX = "ds_ext_zero_topo_rank"


def node_ranks(topology: Topology) -> list[list[int]]:
    """The ranks of each node: the span groups of the level below the outermost (one node when
    the topology has one level)."""
    if len(topology.level_names) < 2:
        return [list(range(topology.world_size))]
    return [list(g) for g in topology.span_groups(topology.level_names[-2])]


def _is_shard(rel: str) -> bool:
    return Path(rel).name.startswith(SHARD_PREFIX)


def _send_bytes(data: bytes, dst: int, group: Any) -> list:
    """Start sending ``data`` to ``dst`` (its size, then its bytes); wait on what it returns (the
    requests hold their tensors)."""
    size = torch.tensor([len(data)], dtype=torch.int64, device="cpu")  # the tiers' gloo group: host
    sends = [(dist.isend(size, dst, group=group), size)]
    if data:
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        sends.append((dist.isend(payload, dst, group=group), payload))
    return sends


def _recv_bytes(src: int, group: Any) -> bytes:
    size = torch.zeros(1, dtype=torch.int64, device="cpu")
    dist.recv(size, src, group=group)
    payload = torch.empty(int(size.item()), dtype=torch.uint8, device="cpu")
    if payload.numel():
        dist.recv(payload, src, group=group)
    return payload.numpy().tobytes()


def _pack(files: dict[str, bytes]) -> bytes:
    header = json.dumps([[rel, len(data)] for rel, data in files.items()]).encode()
    return len(header).to_bytes(8, "little") + header + b"".join(files.values())


def _unpack(blob: bytes) -> dict[str, bytes]:
    n = int.from_bytes(blob[:8], "little")
    at, out = 8 + n, {}
    for rel, size in json.loads(blob[8 : 8 + n]):
        out[rel] = blob[at : at + size]
        at += size
    return out


def _write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    ckpt.atomic_write(path, lambda f: f.write(data))


def _held(tag_dir: Path, rels: list[str]) -> list[str]:
    """The files of ``rels`` present and CRC-checked in ``tag_dir``."""
    out = []
    for rel in rels:
        path = tag_dir / rel
        if not path.is_file():
            continue
        if rel == MANIFEST:
            out.append(rel)
            continue
        try:
            ckpt.check_zip(path)
        except ckpt.CheckpointError:
            continue
        out.append(rel)
    return out


@dataclass
class Restore:
    """A local save chosen for loading: its tag, manifest and which node holds which file."""

    tag: str
    files: dict[str, int]  # relative path -> the rank that wrote it
    holders: dict[str, list[int]]  # relative path -> the nodes holding a good copy


class Tiers:
    """One rank's view of the two tiers (module docstring); collective methods say so."""

    def __init__(self, config: Any, topology: Topology, rank: int, group: Any) -> None:
        self.config, self.rank, self.group = config, rank, group
        self.nodes = node_ranks(topology)
        self.node = next(n for n, ranks in enumerate(self.nodes) if rank in ranks)
        place = self.nodes[self.node].index(rank)
        self.partner = self.nodes[(self.node + 1) % len(self.nodes)][place]
        self.source = self.nodes[(self.node - 1) % len(self.nodes)][place]  # whose partner this rank is
        self.first = self.nodes[self.node][0] == rank  # writes the node's manifest and latest
        self.saves = 0

    def local_dir(self, node: int | None = None) -> Path:
        return Path(self.config.local_dir.replace("{node}", str(self.node if node is None else node)))

    def next_save(self) -> tuple[bool, bool]:
        """(to the local tier, to the shared directory) for the next save."""
        self.saves += 1
        return self.saves % self.config.local_every == 0, self.saves % self.config.shared_every == 0

    # ---- save ------------------------------------------------------------------------
    def prepare(self, tag: str) -> Path:
        """Collective: the node's staging directory for ``tag``, emptied by the node's first rank."""
        staged = ckpt.staging_dir(self.local_dir(), tag)
        error = None
        if self.first:
            try:
                self.local_dir().mkdir(parents=True, exist_ok=True)
                if staged.exists():
                    shutil.rmtree(staged)  # left by a save that crashed
                staged.mkdir()
            except OSError as err:
                error = f"cannot prepare {staged}: {err}"
        ckpt.agree(error, f"preparing the local checkpoint {tag}", self.group)
        return staged

    def save(self, tag: str, staged: Path, files: list[tuple[str, Any]], step: int) -> None:
        """Collective: write this rank's ``files`` (relative path, state) into the node's staging
        directory, copy them to the partner node, then publish the save on every node."""
        what, error, mine = f"saving the local checkpoint {tag}", None, {}
        try:
            for rel, state in files:
                path = staged / rel
                path.parent.mkdir(parents=True, exist_ok=True)
                ckpt.atomic_save(state, path)
                mine[rel] = path.read_bytes()
        except OSError as err:
            error = f"cannot write {staged}: {err}"
        ckpt.agree(error, what, self.group)
        pending = _send_bytes(_pack(mine), self.partner, self.group)
        copies = _unpack(_recv_bytes(self.source, self.group))
        for request, _ in pending:
            request.wait()
        try:
            for rel, data in copies.items():
                _write_bytes(staged / rel, data)
        except OSError as err:
            error = f"cannot write the partner copy into {staged}: {err}"
        written: list[list[str]] = [[] for _ in range(dist.get_world_size())]
        dist.all_gather_object(written, list(mine), group=self.group)
        ckpt.agree(error, what, self.group)
        if self.first:
            try:
                manifest = {"tag": tag, "step": step, "world_size": len(written), "files": {}}
                manifest["files"] = {rel: r for r, rels in enumerate(written) for rel in rels}
                ckpt.atomic_write_text(staged / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
                ckpt.publish(self.local_dir(), tag, True)
            except OSError as err:
                error = f"cannot publish {self.local_dir() / tag}: {err}"
        ckpt.agree(error, what, self.group)

    # ---- load ------------------------------------------------------------------------
    def _manifest(self, tag: str | None) -> dict | None:
        local = self.local_dir()
        if tag is None:
            latest = local / ckpt.LATEST
            if not latest.is_file():
                return None
            tag = latest.read_text().strip()
        try:
            return json.loads((local / tag / MANIFEST).read_text())
        except (OSError, ValueError):
            return None

    def choose(self, tag: str | None) -> tuple[Restore | None, str]:
        """Collective: the newest local save (or ``tag``) that the nodes together hold whole, or
        None and the reason."""
        seen: list[dict | None] = [None] * dist.get_world_size()
        dist.all_gather_object(seen, self._manifest(tag), group=self.group)
        manifests = [m for m in seen if m is not None and m["world_size"] == dist.get_world_size()]
        if not manifests:
            return None, "no node holds a local save" + ("" if tag is None else f" {tag}")
        newest = max(manifests, key=lambda m: m["step"])
        rels = sorted(newest["files"]) + [MANIFEST]
        held: list[list[str]] = [[] for _ in range(dist.get_world_size())]
        dist.all_gather_object(held, _held(self.local_dir() / newest["tag"], rels), group=self.group)
        holders = {rel: [n for n, ranks in enumerate(self.nodes) if rel in held[ranks[0]]] for rel in rels}
        lost = [rel for rel in rels if not holders[rel]]
        if lost:
            return None, f"the local save {newest['tag']} has no copy of {lost[0]} on any node"
        return Restore(newest["tag"], dict(newest["files"]), holders), ""

    def _transfer(self, wants: list[tuple[int, str]], restore: Restore) -> None:
        """Collective: for each (node, relative path), in order, the first rank of the first node
        holding it sends the file to the first rank of that node, which writes it in place."""
        tag_dir = self.local_dir() / restore.tag
        for node, rel in wants:
            src, dst = self.nodes[restore.holders[rel][0]][0], self.nodes[node][0]
            if self.rank == src:
                for request, _ in _send_bytes((tag_dir / rel).read_bytes(), dst, self.group):
                    request.wait()
            elif self.rank == dst:
                _write_bytes(tag_dir / rel, _recv_bytes(src, self.group))
            if node not in restore.holders[rel]:
                restore.holders[rel].append(node)

    def fill_common(self, restore: Restore) -> Path:
        """Collective: every node gets the save's directories, the manifest and DeepSpeed's files it
        lacks; returns this node's tag directory."""
        tag_dir = self.local_dir() / restore.tag
        if self.first:
            for rel in restore.files:
                (tag_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        common = [rel for rel in [MANIFEST, *sorted(restore.files)] if not _is_shard(rel)]
        self._transfer(
            [(n, rel) for n in range(len(self.nodes)) for rel in common if n not in restore.holders[rel]], restore
        )
        dist.barrier(group=self.group)
        return tag_dir

    def fill_missing(self, restore: Restore, missing: Path | None) -> bool:
        """Collective: fetch the shard each rank's load found missing (``missing``, None if it found
        none); False when no rank misses one (the load can go on)."""
        tag_dir = self.local_dir() / restore.tag
        rel = None if missing is None else missing.resolve().relative_to(tag_dir.resolve()).as_posix()
        asked: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(asked, rel, group=self.group)
        wants = sorted({(self._node_of(r), a) for r, a in enumerate(asked) if a is not None})
        unknown = [a for _, a in wants if a not in restore.holders]
        if unknown:
            raise ckpt.CheckpointError(f"the local save {restore.tag} has no file {unknown[0]}")
        self._transfer([(n, a) for n, a in wants if n not in restore.holders[a]], restore)
        dist.barrier(group=self.group)
        return bool(wants)

    def _node_of(self, rank: int) -> int:
        return next(n for n, ranks in enumerate(self.nodes) if rank in ranks)
