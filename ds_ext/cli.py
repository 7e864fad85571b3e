"""``ds-ext`` command line: ``detect``, ``schema``, ``bench <name>``.

``ds-ext detect`` prints the topology read from the launcher environment (or given by
``--preset`` / ``--world-size``) and the groups of the calling rank, or of every rank
with ``--all``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

from ds_ext import config as cfgmod
from ds_ext.bench import BENCHMARKS
from ds_ext.groups import GroupError, TEDLayout, member_group, topology_partition
from ds_ext.runtime import resolve_topology
from ds_ext.topology import PRESET_NAMES, Topology, TopologyError, detect_environment


def _parse_sizes(items: list[str]) -> dict[str, int]:
    out = {}
    for item in items:
        name, _, value = item.partition("=")
        if not value.isdigit():
            raise SystemExit(f"--size expects NAME=INT, got {item!r}")
        out[name] = int(value)
    return out


def _rank_lines(topo: Topology, rank: int) -> list[str]:
    coords = ", ".join(f"{n}={c}" for n, c in zip(topo.level_names, topo.coords(rank)))
    lines = [f"rank {rank}: {coords}"]
    for name in topo.level_names:
        span = member_group(topology_partition(topo, "span", name), rank)
        cross = member_group(topology_partition(topo, "cross", name), rank)
        lines.append(f"  {name:>6}  span {list(span)}  cross {list(cross)}")
    return lines


def cmd_detect(ns: argparse.Namespace) -> int:
    job = detect_environment()
    block = {"preset": ns.preset, "sizes": _parse_sizes(ns.size), "emulate": ns.emulate or ns.world_size is not None}
    topo_cfg = cfgmod.parse({"topology": block}).topology
    world = ns.world_size or job.world_size
    topo = resolve_topology(topo_cfg, world, job)
    print(topo.describe())
    print(f"launcher: {job.source}, world {job.world_size}, rank {job.rank}, "
          f"local size {job.local_size}, nodes {job.num_nodes}, visible devices {list(job.visible_devices)}")
    ranks = range(topo.world_size) if ns.all else [job.rank if ns.rank is None else ns.rank]
    for r in ranks:
        print("\n".join(_rank_lines(topo, r)))
    if ns.ted:
        for r in ranks:
            print("\n".join(_ted_lines(topo, ns.ted, r)))
    return 0


def _ted_lines(topo: Topology, spec: str, rank: int) -> list[str]:
    """The TED groups (001 §7.1) of ``rank`` for ``--ted T,P[,D]`` and the level each spans."""
    degrees = spec.split(",")
    if not 2 <= len(degrees) <= 3 or not all(d.isdigit() for d in degrees):
        raise SystemExit(f"--ted expects TENSOR,EXPERT[,EXPERT_DATA], got {spec!r}")
    try:
        layout = TEDLayout.build(topo.world_size, *map(int, degrees))
        layout.check_placement(topo)
    except GroupError as err:
        raise cfgmod.DsExtConfigError(str(err)) from None
    lines = [f"TED G_tensor={layout.tensor} x G_expert={layout.expert} x G_data^exp={layout.expert_data} "
             f"(G_data^nonexp={layout.nonexp_data})"]
    for kind, level in layout.levels(topo, rank).items():
        lines.append(f"  {kind:<11}  {list(member_group(layout.partition(kind), rank))}  {level or '-'}")
    return lines


def cmd_schema(_: argparse.Namespace) -> int:
    json.dump(cfgmod.json_schema(), sys.stdout, indent=2)
    print()
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ds-ext", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("detect", help="print the topology and process groups")
    d.add_argument("--preset", choices=PRESET_NAMES, default=None)
    d.add_argument("--world-size", type=int, default=None, help="emulate this many ranks")
    d.add_argument("--size", action="append", default=[], metavar="LEVEL=N", help="override a level size")
    d.add_argument("--emulate", action="store_true", help="ignore the launcher's ranks per node")
    d.add_argument("--rank", type=int, default=None, help="show this rank instead of the caller")
    d.add_argument("--all", action="store_true", help="show every rank")
    d.add_argument("--ted", default=None, metavar="T,P[,D]",
                   help="also show the TED groups (tensor, expert, expert-data, data) and their levels")
    d.set_defaults(func=cmd_detect)
    s = sub.add_parser("schema", help="print the JSON schema of the \"ds_ext\" block")
    s.set_defaults(func=cmd_schema)
    b = sub.add_parser("bench", help="run a benchmark (writes JSON and a PNG)")
    bsub = b.add_subparsers(dest="benchmark", required=True)
    for name in BENCHMARKS:
        mod = importlib.import_module(f"ds_ext.bench.{name}")
        bp = bsub.add_parser(name, help=mod.__doc__.splitlines()[0], description=mod.__doc__,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(bp)
        bp.set_defaults(func=mod.run)
    return p


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        result = ns.func(ns)
        return result if isinstance(result, int) else 0
    except (TopologyError, cfgmod.DsExtConfigError) as err:
        print(f"ds-ext: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
