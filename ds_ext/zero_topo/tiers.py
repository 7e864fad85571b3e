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
each node's ``latest`` at its previous complete save. Then the node's first rank removes its
oldest local saves beyond ``keep_local`` (node-local NVMe is small: Frontier's is 2 x 1.92 TB per
node), never the one ``latest`` names.

**Load** (``load_checkpoint`` of the shared directory): the ranks all-gather every local save each
node has published (up to its ``latest``) and the shared directory's ``latest``; newest first, down
to the save the shared ``latest`` names, the first save whose every file has a copy (present,
CRC-checked) on some node is loaded from the local tier: each node first fetches DeepSpeed's files
and the manifest it lacks, then, round by round, every ZeRO-topo shard its ranks' load asks for and
its node lacks (a lost node's shards come from its partner's copies, the rest from its own
directory), each from the first node holding it. An older local save than the newest is loaded
with one line naming the newest's lost file; when none is whole, the newest shared save is loaded,
with one line saying so. (The walk stops at the shared ``latest``'s save: a shared save is a local
one too, so every local save older than it is older than the shared one. A shared save no local
manifest names, e.g. from another job, is not ordered against them and the walk goes on.)

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

from ds_ext import log
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


def _read_latest(directory: Path) -> str | None:
    """The tag ``directory/latest`` names, or None."""
    try:
        return (directory / ckpt.LATEST).read_text().strip()
    except OSError:
        return None


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
            else:
                self._rotate(tag)
        ckpt.agree(error, what, self.group)

    def _rotate(self, newest: str) -> None:
        """The node's first rank, after publishing ``newest``: remove the node's oldest local saves
        beyond ``keep_local``. A save that cannot be removed is reported in one line and training
        goes on (the new save is published; the old one only takes space)."""
        keep = self.config.keep_local
        if keep is None:
            return
        saves = sorted(self._published(), key=lambda m: m["step"], reverse=True)
        old = [m["tag"] for m in saves if m["tag"] != newest][keep - 1 :]
        for tag in old:
            try:
                shutil.rmtree(self.local_dir() / tag)
            except OSError as err:
                log.warn(f"checkpoint_tiers.keep_local {keep}: cannot remove {self.local_dir() / tag}: {err}")

    # ---- load ------------------------------------------------------------------------
    def _published(self) -> list[dict]:
        """The manifests of the node's published local saves (tag directories holding their
        manifest; staging directories are hidden), up to the step of the one ``latest`` names
        (a newer one was published by a save whose agreement did not complete)."""
        local = self.local_dir()
        if not local.is_dir():
            return []
        found = []
        for d in local.iterdir():
            if d.name.startswith(".") or not d.is_dir():
                continue
            manifest = self._manifest(d.name)
            if manifest is not None and manifest.get("tag") == d.name:
                found.append(manifest)
        latest = _read_latest(local)
        top = next((m["step"] for m in found if m["tag"] == latest), None)
        return [m for m in found if top is not None and m["step"] <= top]

    def _manifest(self, tag: str) -> dict | None:
        """The manifest of the node's local save ``tag``, or None (absent or unreadable)."""
        try:
            return json.loads((self.local_dir() / tag / MANIFEST).read_text())
        except (OSError, ValueError):
            return None

    def choose(self, tag: str | None, shared_dir: Path) -> tuple[Restore | None, str]:
        """Collective: ``tag``'s local save, or the newest local save the nodes together hold
        whole (module docstring: at most as old as the shared ``latest``'s), or None; and the line
        to say (empty when the newest is loaded)."""
        world = dist.get_world_size()
        seen: list[tuple[list[dict], str | None]] = [([], None)] * world
        mine = [m for m in [self._manifest(tag)] if m is not None] if tag is not None else self._published()
        dist.all_gather_object(seen, (mine, _read_latest(Path(shared_dir))), group=self.group)
        by_tag = {m["tag"]: m for saves, _ in seen for m in saves if m["world_size"] == world}
        if not by_tag:
            return None, "no node holds a local save" + ("" if tag is None else f" {tag}")
        shared = seen[0][1]
        first_lost = ""
        for manifest in sorted(by_tag.values(), key=lambda m: m["step"], reverse=True):
            rels = sorted(manifest["files"]) + [MANIFEST]
            held: list[list[str]] = [[] for _ in range(world)]
            dist.all_gather_object(held, _held(self.local_dir() / manifest["tag"], rels), group=self.group)
            holders = {rel: [n for n, ranks in enumerate(self.nodes) if rel in held[ranks[0]]] for rel in rels}
            lost = [rel for rel in rels if not holders[rel]]
            if not lost:
                said = f"{first_lost}: loading the older local save {manifest['tag']}" if first_lost else ""
                return Restore(manifest["tag"], dict(manifest["files"]), holders), said
            first_lost = first_lost or f"the local save {manifest['tag']} has no copy of {lost[0]} on any node"
            if manifest["tag"] == shared:
                break
        return None, first_lost + ("" if len(by_tag) == 1 else ", nor has an older local save every file")

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
