"""``ds-ext`` command line: ``detect``, ``schema``, ``bench <name>``, ``tune``, ``plan``, ``simulate``,
``checkpoint``, ``run``, ``autoload-path``.

``ds-ext detect`` prints the topology read from the launcher environment (or given by
``--preset`` / ``--world-size``) and the groups of the calling rank, or of every rank
with ``--all``; with ``--grid X,Y,Z,D`` also which level each 3D-PMM grid axis spans.
``ds-ext tune`` ranks the 3D-PMM grids of a model (001 §5.1.2) through the planner, the code
path of ``ds-ext plan --families pmm3d``, optionally from a bandwidth database that
``ds-ext tune --measure`` writes.

``detect``, ``plan``, ``simulate``, ``tune`` (without ``--measure``), ``schema`` and every ``--help``
are arithmetic and import no torch: the modules that need torch (runtime, benchmarks, local
worlds, checkpoints) are imported inside the commands that use them (``tests/test_cli.py``).
Every ds_ext error (:class:`ds_ext.errors.DsExtError`) and every unreadable file is one line on
stderr and exit status 2, as argparse's own errors are.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

from ds_ext import __version__
from ds_ext.cluster import command as cluster_command
from ds_ext.errors import DsExtError
from ds_ext.planner import command as planner_command
from ds_ext.planner.command import ArgumentError
from ds_ext.topology import PRESET_NAMES, Topology, detect_environment, preset_levels

DESCRIPTION = (
    "Topology-aware extensions for DeepSpeed: show the topology and process groups, plan and simulate "
    "parallel layouts, run a DeepSpeed script with ds_ext active, consolidate checkpoints, benchmark."
)
EPILOG = "Run 'ds-ext COMMAND --help' for a command's options. Errors: one line on stderr, exit status 2."

EMULATE_MESSAGE_MB = 16.0
NETNS_MESSAGE_MB = 2.0  # 0.4 s per message on a 40 Mbit/s link


def _rank_lines(topo: Topology, rank: int) -> list[str]:
    from ds_ext.groups import topology_partition
    from ds_ext.parallel import member_group

    coords = ", ".join(f"{n}={c}" for n, c in zip(topo.level_names, topo.coords(rank)))
    lines = [f"rank {rank}: {coords}"]
    for name in topo.level_names:
        span = member_group(topology_partition(topo, "span", name), rank)
        cross = member_group(topology_partition(topo, "cross", name), rank)
        lines.append(f"  {name:>6}  span {list(span)}  cross {list(cross)}")
    return lines


def cmd_detect(ns: argparse.Namespace) -> int:
    from ds_ext import config as cfgmod
    from ds_ext.topology import resolve_topology

    job = detect_environment()
    block = {
        "preset": ns.preset,
        "sizes": planner_command.parse_sizes(ns.size),
        "emulate": ns.emulate or ns.world_size is not None,
    }
    topo_cfg = cfgmod.parse({"topology": block}).topology
    world = ns.world_size or job.world_size
    topo = resolve_topology(topo_cfg, world, job)
    lines = [
        topo.describe(),
        f"launcher: {job.source}, world {job.world_size}, rank {job.rank}, local size "
        f"{job.local_size}, nodes {job.num_nodes}, visible devices {list(job.visible_devices)}",
    ]
    ranks = range(topo.world_size) if ns.all else [job.rank if ns.rank is None else ns.rank]
    for r in ranks:
        lines += _rank_lines(topo, r)
    if ns.grid is not None:
        lines.append(_grid_lines(topo, ns.grid))
    if ns.ted:
        for r in ranks:
            lines += _ted_lines(topo, ns.ted, r)
    print("\n".join(lines))  # all checked first: a refused --rank, --grid or --ted prints nothing
    return 0


def _parse_grid(text: str) -> tuple[int, int, int, int]:
    parts = text.split(",")
    if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"expects X,Y,Z,DATA (positive integers), got {text!r}")
    return tuple(int(p) for p in parts)  # type: ignore[return-value]


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expects a positive integer, got {text!r}")
    return int(text)


def _rank(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expects a rank (an integer >= 0), got {text!r}")
    return int(text)


def _grid_lines(topo: Topology, dims: tuple[int, int, int, int]) -> str:
    from ds_ext.parallel import Grid

    grid = Grid(*dims)
    grid.check_world(topo.world_size)
    spans = grid.parallel_dims.spans(topo)
    axes = ", ".join(f"{a}={getattr(grid, a)} spans {spans[a] or '-'}" for a in ("x", "y", "z", "data"))
    return f"pmm3d grid {grid}: {axes}"


def cmd_tune(ns: argparse.Namespace) -> int:
    """``--measure``: the bandwidth database on local ranks (torch); else the planner's 3D-PMM
    ranking (``ds_ext.planner.command.run_tune``), the code path of ``plan --families pmm3d``."""
    if not ns.measure:
        return planner_command.run_tune(ns)
    given = [f"--{k.replace('_', '-')}" for k in planner_command.TUNE_RANKING[:-1] if getattr(ns, k) is not None]
    if given:
        raise planner_command.ArgumentError(
            f"--measure: takes no {' '.join(given)} (they rank grids; --measure writes the bandwidth database)"
        )
    if ns.network == "netns":
        return _tune_measure_netns(ns)
    from ds_ext.local_world import World
    from ds_ext.planner import machine as machines

    preset = machines.lookup(ns.machine).topology
    block = {"preset": preset, "sizes": planner_command.parse_sizes(ns.size), "emulate": True}
    Topology.build(preset_levels(preset), ns.world, preset, block["sizes"])  # refuse a bad world before starting
    with World(ns.world) as world:
        db = world.run(
            tune_measure_on_rank, block, int((ns.message_MB or EMULATE_MESSAGE_MB) * 2**20), True, ns.time_scale
        )[0]
    print(json.dumps(db, indent=2))
    if ns.out:
        Path(ns.out).write_text(json.dumps(db, indent=2) + "\n")
    return 0


def tune_measure_on_rank(topology_block: dict, message_bytes: int, emulate_time: bool, time_scale: float) -> dict:
    """:func:`ds_ext.pmm.tune.measure_database` on this rank of a started job (``ds_ext.local_world``
    or a launcher), in a Runtime of ``topology_block``.

    With emulation, link times are stretched by ``time_scale`` (so that they dominate gloo's
    own time on one host) and the measured bandwidths are multiplied back by it: the
    database then describes the emulated machine.
    """
    from ds_ext import config as cfgmod
    from ds_ext.pmm.tune import measure_database
    from ds_ext.runtime import Runtime

    block = {"topology": topology_block, "comm": {"emulate_time": emulate_time, "time_scale": time_scale}}
    rt = Runtime.create(cfgmod.parse(block))
    db = measure_database(rt.comm, rt.topology, message_bytes)
    scale = time_scale if emulate_time else 1.0
    db["intra"] = {k: v * scale for k, v in db["intra"].items()}
    if db["beta_inter"] is not None:
        db["beta_inter"] *= scale
    return db


def _tune_measure_netns(ns: argparse.Namespace) -> int:
    """``ds-ext tune --measure --network netns``: the per-level network of an emulated cluster
    of ``--nodes`` nodes and ``--world`` ranks, measured by its ranks."""
    if ns.world % ns.nodes:
        raise ArgumentError(f"--world {ns.world} does not split over --nodes {ns.nodes}")
    spec = cluster_command.spec_from_args(ns, ns.world // ns.nodes)
    db = cluster_command.measure_network(spec, int((ns.message_MB or NETNS_MESSAGE_MB) * 2**20))
    print(f"{spec.describe()} (measured, netns)")
    print(cluster_command.format_measurement(db))
    if ns.out:
        Path(ns.out).write_text(json.dumps(db, indent=2) + "\n")
    return 0


def _checkpoint_dir(p: Path, tag: str | None) -> Path:
    """A ZeRO-topo tag directory from a save directory (its ``latest`` or ``--tag``) or the
    tag directory itself."""
    from ds_ext.zero_topo import checkpoint as ckpt

    if tag is None and (any(p.glob(ckpt.SHARD_FILE.replace("{rank:05d}", "*"))) or ckpt.model_parallel_parts(p)):
        return p
    if tag is None and not (p / ckpt.LATEST).is_file():
        raise ckpt.CheckpointError(
            f"checkpoint directory {p} has no '{ckpt.LATEST}' file and no shards; pass --tag TAG, or the tag directory"
        )
    return ckpt.resolve_tag_dir(p, tag)


def _pmm_tag_dir(p: Path, tag: str | None) -> Path | None:
    """A 3D-PMM tag directory (one with ``pmm3d/``) from a save or tag directory, else None."""
    from ds_ext.pmm import checkpoint as pmm_ckpt

    if tag is None and (p / pmm_ckpt.DIR).is_dir():
        return p
    if tag is None and (p / "latest").is_file():
        tag = (p / "latest").read_text().strip()
    return p / tag if tag is not None and (p / tag / pmm_ckpt.DIR).is_dir() else None


def cmd_pmm_checkpoint(ns: argparse.Namespace, tag_dir: Path) -> int:
    import torch

    from ds_ext.pmm import checkpoint as pmm_ckpt

    record = pmm_ckpt.read_record(tag_dir)
    if ns.action == "inspect":
        print(
            f"3D-PMM checkpoint {tag_dir}: grid {record['grid']}, {len(record['params'])} parameters, "
            f"optimizer state: {record['optimizer']}, Hugging Face: {(record['hf'] or {}).get('class')}"
        )
        return 0
    state = pmm_ckpt.consolidate(tag_dir)
    torch.save(state, ns.out)
    if ns.hf_dir:
        pmm_ckpt.save_pretrained(tag_dir, state, ns.hf_dir)
    n = sum(t.numel() for t in state.values())
    print(
        f"wrote {ns.out}: {len(state)} tensors, {n:,} parameters of the serial model from {tag_dir} "
        f"(3D-PMM grid {record['grid']})" + (f"; Hugging Face save_pretrained in {ns.hf_dir}" if ns.hf_dir else "")
    )
    return 0


def cmd_checkpoint(ns: argparse.Namespace) -> int:
    import torch

    from ds_ext.zero_topo import checkpoint as ckpt

    save_dir = Path(ns.ckpt_dir)
    if not save_dir.is_dir():
        why = "is not a directory" if save_dir.exists() else "does not exist"
        raise ckpt.CheckpointError(f"checkpoint directory {save_dir} {why}")
    pmm_dir = _pmm_tag_dir(save_dir, ns.tag)
    if pmm_dir is not None:
        if ns.action == "export":
            raise ArgumentError(
                "checkpoint export: a ZeRO-topo checkpoint; for a 3D-PMM one of a Hugging Face model: consolidate --hf-dir"
            )
        return cmd_pmm_checkpoint(ns, pmm_dir)
    if getattr(ns, "hf_dir", None):
        raise ArgumentError("--hf-dir: only a 3D-PMM checkpoint (with pmm3d/) of a Hugging Face model")
    tag_dir = _checkpoint_dir(save_dir, ns.tag)
    if ns.action == "inspect":
        print(ckpt.describe(tag_dir))
        return 0
    if ns.action == "export":
        return cmd_checkpoint_export(ns, tag_dir)
    state = ckpt.consolidate(tag_dir)
    torch.save(state, ns.out)
    n = sum(t.numel() for t in {id(t): t for t in state.values()}.values())
    print(f"wrote {ns.out}: {len(state)} tensors, {n:,} fp32 parameters from {tag_dir}")
    return 0


def cmd_checkpoint_export(ns: argparse.Namespace, tag_dir: Path) -> int:
    from ds_ext.zero_topo import export

    out = Path(ns.out_dir)
    if ns.format == "safetensors":
        done = export.export_safetensors(tag_dir, out, int(ns.max_shard_MB * 2**20), ns.dtype)
    else:
        done = export.export_dcp(tag_dir, out, ns.dtype)
    print(
        f"wrote {out}: {ns.format}, {len(done.files)} files, {done.tensors} tensors, {done.parameters:,} "
        f"{ns.dtype} parameters ({done.total_bytes:,} bytes) from {tag_dir}"
    )
    return 0


def cmd_checkpoint_import(ns: argparse.Namespace) -> int:
    import torch

    from ds_ext.zero_topo import export

    src, out = Path(ns.src), Path(ns.out)
    if not src.is_dir():
        raise export.CheckpointError(f"import: {src} is not a directory")
    if ns.format == "safetensors":
        torch.save(export.import_safetensors(src), out)
    else:
        export.import_dcp(src, out)
    state = torch.load(out, weights_only=True, mmap=True)
    n = sum(t.numel() for t in {id(t): t for t in state.values()}.values())
    print(
        f"wrote {out}: {len(state)} tensors, {n:,} parameters from {ns.format} {src} "
        "(model.load_state_dict(torch.load(path, weights_only=True)) before ds_ext.initialize)"
    )
    return 0


def cmd_autoload_path(_: argparse.Namespace) -> int:
    import os

    import ds_ext

    print(os.path.join(os.path.dirname(ds_ext.__file__), "autoload"))
    return 0


def cmd_run(argv: list[str]) -> int:
    """``ds-ext run ...``: ``python -m ds_ext.run ...`` (its own arguments: argparse would take a
    script's options for ds-ext's)."""
    from ds_ext.run import run_process

    run_process(argv)
    return 0


def _ted_lines(topo: Topology, spec: str, rank: int) -> list[str]:
    """The TED groups (001 §7.1) of ``rank`` for ``--ted T,P[,D]`` and the level each spans."""
    from ds_ext.parallel import TEDLayout, member_group

    degrees = spec.split(",")
    if not 2 <= len(degrees) <= 3 or not all(d.isdigit() for d in degrees):
        raise ArgumentError(f"--ted expects TENSOR,EXPERT[,EXPERT_DATA], got {spec!r}")
    layout = TEDLayout.build(topo.world_size, *map(int, degrees))
    layout.check_placement(topo)
    lines = [
        f"TED G_tensor={layout.tensor} x G_expert={layout.expert} x G_data^exp={layout.expert_data} "
        f"(G_data^nonexp={layout.nonexp_data})"
    ]
    for kind, level in layout.levels(topo, rank).items():
        lines.append(f"  {kind:<11}  {list(member_group(layout.partition(kind), rank))}  {level or '-'}")
    return lines


def cmd_schema(_: argparse.Namespace) -> int:
    from ds_ext.config import json_schema

    json.dump(json_schema(), sys.stdout, indent=2)
    print()
    return 0


def build_parser(benchmarks: bool = True) -> argparse.ArgumentParser:
    """The parser; ``benchmarks=False`` leaves the benchmark modules (torch) unimported and
    their sub-commands without arguments (for a command line that is not ``bench``)."""
    p = argparse.ArgumentParser(prog="ds-ext", description=DESCRIPTION, epilog=EPILOG)
    p.add_argument("--version", action="version", version=f"ds-ext {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("detect", help="print the topology and process groups")
    d.add_argument("--preset", choices=PRESET_NAMES, default=None)
    d.add_argument("--world-size", type=_positive_int, default=None, help="emulate this many ranks")
    d.add_argument("--size", action="append", default=[], metavar="LEVEL=N", help="override a level size")
    d.add_argument("--emulate", action="store_true", help="ignore the launcher's ranks per node")
    d.add_argument("--rank", type=_rank, default=None, help="show this rank instead of the caller")
    d.add_argument("--all", action="store_true", help="show every rank")
    d.add_argument(
        "--grid",
        type=_parse_grid,
        default=None,
        metavar="X,Y,Z,DATA",
        help="also show the topology level each 3D-PMM grid axis spans",
    )
    d.add_argument(
        "--ted",
        default=None,
        metavar="T,P[,D]",
        help="also show the TED groups (tensor, expert, expert-data, data) and their levels",
    )
    d.set_defaults(func=cmd_detect)
    t = sub.add_parser(
        "tune",
        help="rank the 3D-PMM grids of a model (001 §5.1.2) as plan --families pmm3d does; "
        "--measure: bandwidth database",
    )
    planner_command.add_tune_arguments(t)
    t.add_argument(
        "--measure",
        action="store_true",
        help="measure the database on --world local ranks with alpha-beta emulation of --machine's levels",
    )
    t.add_argument(
        "--message-MB",
        type=float,
        default=None,
        help=f"--measure: message size (default {EMULATE_MESSAGE_MB:g} emulated, {NETNS_MESSAGE_MB:g} netns)",
    )
    t.add_argument(
        "--time-scale",
        type=float,
        default=3000.0,
        help="--measure: stretch emulated link times so they dominate gloo's own (results are scaled back)",
    )
    t.add_argument(
        "--network",
        choices=("emulate", "netns"),
        default="emulate",
        help="--measure on: emulate (alpha-beta sleeps of --machine's levels, local ranks) or netns (an emulated "
        "cluster of --nodes network namespaces with shaped links: measured, not modelled)",
    )
    cluster_command.add_cluster_arguments(t, ranks_per_node=False)
    t.set_defaults(func=cmd_tune)
    pl = sub.add_parser("plan", help="memory, bytes per level and step time of every plan of a model; the best two")
    planner_command.add_plan_arguments(pl)
    pl.set_defaults(func=planner_command.run_plan)
    sm = sub.add_parser("simulate", help="sweep models x nodes x plans: predicted TFLOPS per GCD, scaling efficiency")
    planner_command.add_simulate_arguments(sm)
    sm.set_defaults(func=planner_command.run_simulate)
    s = sub.add_parser("schema", help='print the JSON schema of the "ds_ext" block')
    s.set_defaults(func=cmd_schema)
    sub.add_parser(
        "run",
        help="run an unmodified DeepSpeed script with ds_ext active (python -m ds_ext.run); "
        "'ds-ext run --help' for its usage",
        add_help=False,
    )
    a = sub.add_parser(
        "autoload-path",
        help="print the directory to put on PYTHONPATH to activate ds_ext in "
        "every process (launchers that build the rank command themselves)",
    )
    a.set_defaults(func=cmd_autoload_path)
    c = sub.add_parser("checkpoint", help="consolidate, inspect, export or import a ZeRO-topo or 3D-PMM checkpoint")
    csub = c.add_subparsers(dest="action", required=True)
    cc = csub.add_parser("consolidate", help="write the full fp32 state dict (torch.load(..., weights_only=True))")
    cc.add_argument("ckpt_dir", help="the save directory (uses its 'latest') or a tag directory")
    cc.add_argument("out", help="output file")
    cc.add_argument(
        "--hf-dir",
        default=None,
        help="3D-PMM checkpoint of a Hugging Face model: also write a save_pretrained directory here",
    )
    ci = csub.add_parser("inspect", help="print what a checkpoint holds")
    ci.add_argument("ckpt_dir", help="the save directory (uses its 'latest') or a tag directory")
    ce = csub.add_parser(
        "export",
        help="write a ZeRO-topo checkpoint as sharded Hugging Face safetensors (streamed) or a "
        "torch.distributed.checkpoint (FSDP2 / torchtitan load it at any world size)",
    )
    ce.add_argument("ckpt_dir", help="the save directory (uses its 'latest') or a tag directory")
    ce.add_argument("out_dir", help="a new or empty output directory")
    ce.add_argument("--format", choices=("safetensors", "dcp"), required=True)
    ce.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32", help="default: fp32, the masters")
    ce.add_argument(
        "--max-shard-MB", type=float, default=2048.0, help="safetensors: the largest output file (default 2048)"
    )
    for sp in (cc, ci, ce):
        sp.add_argument("--tag", default=None, help="tag to use instead of 'latest'")
        sp.set_defaults(func=cmd_checkpoint)
    cm = csub.add_parser(
        "import",
        help="the way back: a safetensors directory or a torch.distributed.checkpoint as one state dict "
        "(model.load_state_dict before ds_ext.initialize; the weights only)",
    )
    cm.add_argument("src", help="a safetensors directory (an export, or Hugging Face's) or a DCP directory")
    cm.add_argument("out", help="output file (torch.load(..., weights_only=True))")
    cm.add_argument("--format", choices=("safetensors", "dcp"), required=True)
    cm.set_defaults(func=cmd_checkpoint_import)
    cl = sub.add_parser(
        "cluster",
        help="run a command on the ranks of an emulated cluster: nodes as network namespaces with tc-shaped links",
        description=cluster_command.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    cluster_command.add_arguments(cl)
    cl.set_defaults(func=cluster_command.cmd_cluster)
    b = sub.add_parser("bench", help="run a benchmark (writes JSON and a PNG)")
    bsub = b.add_subparsers(dest="benchmark", required=True)
    from ds_ext.bench import BENCHMARKS

    for name in BENCHMARKS:
        if not benchmarks:
            bsub.add_parser(name)
            continue
        mod = importlib.import_module(f"ds_ext.bench.{name}")
        bp = bsub.add_parser(
            name,
            help=mod.__doc__.splitlines()[0],
            description=mod.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        mod.add_arguments(bp)
        bp.set_defaults(func=mod.run)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one command; a ds_ext error, or a file that cannot be read, is one line on stderr and
    exit status 2 (argparse's status for bad arguments)."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv[:1] == ["run"]:
            return cmd_run(argv[1:])
        ns = build_parser(benchmarks=argv[:1] == ["bench"]).parse_args(argv)
        result = ns.func(ns)
        return result if isinstance(result, int) else 0
    except DsExtError as err:
        print(f"ds-ext: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:
        if err.filename is None:
            raise
        print(f"ds-ext: error: {err.strerror}: {err.filename}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
