"""``ds-ext`` command line: ``detect``, ``schema``, ``bench <name>``, ``tune``, ``plan``, ``simulate``,
``checkpoint``, ``run``, ``autoload-path``.

``ds-ext detect`` prints the topology read from the launcher environment (or given by
``--preset`` / ``--world-size``) and the groups of the calling rank, or of every rank
with ``--all``; with ``--grid X,Y,Z,D`` also which level each 3D-PMM grid axis spans.
``ds-ext tune`` ranks the 3D-PMM grids of a model (001 §5.1.2), optionally from a bandwidth
database that ``ds-ext tune --measure`` writes.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

from ds_ext import config as cfgmod
from ds_ext.bench import BENCHMARKS
from ds_ext.cluster import command as cluster_command
from ds_ext.cluster.spec import ClusterError
from ds_ext.groups import GroupError, TEDLayout, member_group, topology_partition
from ds_ext.planner import PlannerError
from ds_ext.planner import command as planner_command
from ds_ext.runtime import resolve_topology
from ds_ext.topology import PRESET_NAMES, Topology, TopologyError, detect_environment


EMULATE_MESSAGE_MB = 16.0
NETNS_MESSAGE_MB = 2.0  # 0.4 s per message on a 40 Mbit/s link


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
    if ns.grid is not None:
        print(_grid_lines(topo, ns.grid))
    if ns.ted:
        for r in ranks:
            print("\n".join(_ted_lines(topo, ns.ted, r)))
    return 0


def _parse_grid(text: str) -> tuple[int, int, int, int]:
    parts = text.split(",")
    if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise SystemExit(f"--grid expects X,Y,Z,DATA (positive integers), got {text!r}")
    return tuple(int(p) for p in parts)  # type: ignore[return-value]


def _grid_lines(topo: Topology, dims: tuple[int, int, int, int]) -> str:
    from ds_ext.groups import axis_levels
    from ds_ext.pmm.grid import Grid, GridError

    grid = Grid(*dims)
    try:
        grid.check_world(topo.world_size)
    except GridError as err:
        raise SystemExit(f"ds-ext: error: {err}") from None
    spans = axis_levels(grid.axes(), topo)
    axes = ", ".join(f"{a}={getattr(grid, a)} spans {spans[a] or '-'}" for a in ("x", "y", "z", "data"))
    return f"pmm3d grid {grid}: {axes}"


def cmd_tune(ns: argparse.Namespace) -> int:
    from ds_ext.perf import pmm as perf
    from ds_ext.pmm import tune

    if ns.measure and ns.network == "netns":
        return _tune_measure_netns(ns)
    block = {"preset": ns.preset, "sizes": _parse_sizes(ns.size), "emulate": True}
    topo = resolve_topology(cfgmod.parse({"topology": block}).topology, ns.world, detect_environment())
    if ns.measure:
        from ds_ext.local_world import World

        with World(ns.world) as world:
            db = world.run(tune.measure_on_rank, block, int((ns.message_MB or EMULATE_MESSAGE_MB) * 2**20), True, ns.time_scale)[0]
        print(json.dumps(db, indent=2))
        if ns.out:
            Path(ns.out).write_text(json.dumps(db, indent=2) + "\n")
        return 0
    layers, hidden, heads = perf.TABLE_5_1[ns.model]
    spec = perf.gpt_spec(hidden, layers, heads, ns.vocab, ns.seq_len)
    database = json.loads(Path(ns.database).read_text()) if ns.database else None
    bw = tune.bandwidths(topo, database, ns.links)
    limit = ns.memory_GB * 1e9 if ns.memory_GB else None
    top = tune.top_grids(spec, topo, ns.global_batch, ns.seq_len, 2, ns.zero_stage, limit, bw, ns.top_k, ns.latency)
    print(f"{ns.model} ({layers} layers, hidden {hidden}, {heads} heads) on {topo.describe()}")
    print(f"{'#':>3} {'x':>4} {'y':>4} {'z':>4} {'data':>5} {'comm s':>10} {'GB/rank':>9}  levels (x, y, z, data)")
    for i, r in enumerate(top, 1):
        g, lv = r["grid"], r["levels"]
        print(f"{i:>3} {g['x']:>4} {g['y']:>4} {g['z']:>4} {g['data']:>5} {r['predicted_comm_s']:>10.4f} "
              f"{r['memory_per_rank_bytes'] / 1e9:>9.2f}  " + ", ".join(lv[a] or "-" for a in ("x", "y", "z", "data")))
    if ns.out:
        Path(ns.out).write_text(json.dumps({"model": ns.model, "world": ns.world, "links": ns.links,
                                            "latency": ns.latency, "top": top}, indent=2) + "\n")
    return 0


def _tune_measure_netns(ns: argparse.Namespace) -> int:
    """``ds-ext tune --measure --network netns``: the per-level network of an emulated cluster
    of ``--nodes`` nodes and ``--world`` ranks, measured by its ranks."""
    if ns.world % ns.nodes:
        raise SystemExit(f"ds-ext: error: --world {ns.world} does not split over --nodes {ns.nodes}")
    try:
        spec = cluster_command.spec_from_args(ns, ns.world // ns.nodes)
        db = cluster_command.measure_network(spec, int((ns.message_MB or NETNS_MESSAGE_MB) * 2**20))
    except ClusterError as err:
        print(f"ds-ext tune --network netns: {err}", file=sys.stderr)
        return 2
    print(f"{spec.describe()} (measured, netns)")
    print(cluster_command.format_measurement(db))
    if ns.out:
        Path(ns.out).write_text(json.dumps(db, indent=2) + "\n")
    return 0


def _checkpoint_dir(path: str, tag: str | None):
    """A ZeRO-topo tag directory from a save directory (its ``latest`` or ``--tag``) or the
    tag directory itself."""
    from pathlib import Path

    from ds_ext.zero_topo import checkpoint as ckpt

    p = Path(path)
    if tag is None and any(p.glob(ckpt.SHARD_FILE.replace("{rank:05d}", "*"))):
        return p
    return ckpt.resolve_tag_dir(p, tag)


def cmd_checkpoint(ns: argparse.Namespace) -> int:
    import torch

    from ds_ext.zero_topo import checkpoint as ckpt

    try:
        tag_dir = _checkpoint_dir(ns.ckpt_dir, ns.tag)
        if ns.action == "inspect":
            print(ckpt.describe(tag_dir))
            return 0
        state = ckpt.consolidate(tag_dir)
        torch.save(state, ns.out)
    except ckpt.CheckpointError as err:
        print(f"ds-ext: error: {err}", file=sys.stderr)
        return 2
    n = sum(t.numel() for t in {id(t): t for t in state.values()}.values())
    print(f"wrote {ns.out}: {len(state)} tensors, {n:,} fp32 parameters from {tag_dir}")
    return 0


def cmd_autoload_path(_: argparse.Namespace) -> int:
    import os

    import ds_ext

    print(os.path.join(os.path.dirname(ds_ext.__file__), "autoload"))
    return 0


def cmd_run(ns: argparse.Namespace) -> int:
    from ds_ext.run import main as run_main

    run_main(ns.script_and_args)
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


def _table_5_1() -> tuple[str, ...]:
    from ds_ext.perf.pmm import TABLE_5_1

    return tuple(TABLE_5_1)


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
    d.add_argument("--grid", type=_parse_grid, default=None, metavar="X,Y,Z,DATA",
                   help="also show the topology level each 3D-PMM grid axis spans")
    d.add_argument("--ted", default=None, metavar="T,P[,D]",
                   help="also show the TED groups (tensor, expert, expert-data, data) and their levels")
    d.set_defaults(func=cmd_detect)
    t = sub.add_parser("tune", help="rank the 3D-PMM grids of a model (001 §5.1.2); --measure: bandwidth database")
    t.add_argument("--model", choices=sorted(_table_5_1()), default="gpt-20b", help="a GPT of 001 Table 5.1")
    t.add_argument("--world", type=int, required=True, help="ranks (GPUs / GCDs)")
    t.add_argument("--preset", choices=PRESET_NAMES, default="frontier")
    t.add_argument("--size", action="append", default=[], metavar="LEVEL=N", help="override a level size")
    t.add_argument("--global-batch", type=int, default=1024, help="sequences per step")
    t.add_argument("--seq-len", type=int, default=2048)
    t.add_argument("--vocab", type=int, default=50304)
    t.add_argument("--zero-stage", type=int, default=1, choices=(0, 1, 2))
    t.add_argument("--memory-GB", type=float, default=None, help="model-state bytes allowed per rank")
    t.add_argument("--database", default=None, help="bandwidth database JSON from 'ds-ext tune --measure'")
    t.add_argument("--links", choices=("shared", "per-rank"), default="shared",
                   help="shared: Eq 5.7 (rings across nodes share a node's NICs); per-rank: every rank its own share "
                        "of each level (the machine ds_ext's alpha-beta emulation emulates)")
    t.add_argument("--latency", action="store_true",
                   help="add the level's latency per ring message (drops 001's bandwidth-bound Assumption 3)")
    t.add_argument("--top-k", type=int, default=10)
    t.add_argument("--out", default=None, help="write the result as JSON")
    t.add_argument("--measure", action="store_true",
                   help="measure the database on --world local ranks with alpha-beta emulation of --preset")
    t.add_argument("--message-MB", type=float, default=None,
                   help=f"--measure: message size (default {EMULATE_MESSAGE_MB:g} emulated, {NETNS_MESSAGE_MB:g} netns)")
    t.add_argument("--time-scale", type=float, default=3000.0,
                   help="--measure: stretch emulated link times so they dominate gloo's own (results are scaled back)")
    t.add_argument("--network", choices=("emulate", "netns"), default="emulate",
                   help="--measure on: emulate (alpha-beta sleeps of --preset, local ranks) or netns (an emulated "
                        "cluster of --nodes network namespaces with shaped links: measured, not modelled)")
    cluster_command.add_cluster_arguments(t, ranks_per_node=False)
    t.set_defaults(func=cmd_tune)
    pl = sub.add_parser("plan", help="memory, bytes per level and step time of every plan of a model; the best two")
    planner_command.add_plan_arguments(pl)
    pl.set_defaults(func=planner_command.run_plan)
    sm = sub.add_parser("simulate", help="sweep models x nodes x plans: predicted TFLOPS per GCD, scaling efficiency")
    planner_command.add_simulate_arguments(sm)
    sm.set_defaults(func=planner_command.run_simulate)
    s = sub.add_parser("schema", help="print the JSON schema of the \"ds_ext\" block")
    s.set_defaults(func=cmd_schema)
    r = sub.add_parser("run", help="run an unmodified DeepSpeed script with ds_ext active (python -m ds_ext.run)",
                       add_help=False)
    r.add_argument("script_and_args", nargs=argparse.REMAINDER)
    r.set_defaults(func=cmd_run)
    a = sub.add_parser("autoload-path", help="print the directory to put on PYTHONPATH to activate ds_ext in "
                                            "every process (launchers that build the rank command themselves)")
    a.set_defaults(func=cmd_autoload_path)
    c = sub.add_parser("checkpoint", help="consolidate or inspect a ZeRO-topo checkpoint")
    csub = c.add_subparsers(dest="action", required=True)
    cc = csub.add_parser("consolidate", help="write the full fp32 state dict (torch.load(..., weights_only=True))")
    cc.add_argument("ckpt_dir", help="the save directory (uses its 'latest') or a tag directory")
    cc.add_argument("out", help="output file")
    ci = csub.add_parser("inspect", help="print what a checkpoint holds")
    ci.add_argument("ckpt_dir", help="the save directory (uses its 'latest') or a tag directory")
    for sp in (cc, ci):
        sp.add_argument("--tag", default=None, help="tag to use instead of 'latest'")
        sp.set_defaults(func=cmd_checkpoint)
    cl = sub.add_parser("cluster", help="run a command on the ranks of an emulated cluster: nodes as network "
                                        "namespaces with tc-shaped links", description=cluster_command.__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    cluster_command.add_arguments(cl)
    cl.set_defaults(func=cluster_command.cmd_cluster)
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
    except (TopologyError, cfgmod.DsExtConfigError, PlannerError) as err:
        print(f"ds-ext: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
