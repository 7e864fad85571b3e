"""The layers of DESIGN.md §1 hold, every module of ds_ext is in one, and no module of ds_ext
imports itself through others.

``.importlinter`` states the layers (cli > bench > tools > activation > initialize > runtime >
config schema > plugins > models > base plugins > perf / plugin contract > DeepSpeed touch points >
comm > groups > parallel > topology and leaves > errors; docs/architecture.md) and keeps the schema
and the analytic models torch-free; ``lint-imports`` checks it on this checkout. Import cycles count
every import: at module top, inside functions and under ``TYPE_CHECKING`` (a function-level import
that only dodges a cycle is still one).
"""

import configparser
import os
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def test_import_contracts_kept():
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())",
            "--no-cache",
            "--config",
            str(ROOT / ".importlinter"),
        ],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]


def test_no_import_cycles():
    script = (
        "import grimp\n"
        "g = grimp.build_graph('ds_ext', cache_dir=None)\n"
        "for a in sorted(g.modules):\n"
        "    for b in sorted(g.find_modules_directly_imported_by(a)):\n"
        "        back = g.find_shortest_chain(importer=b, imported=a)\n"
        "        if back is not None:\n"
        "            print(' -> '.join((a,) + tuple(back)))\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout == "", "import cycles:\n" + run.stdout


def _layer_modules() -> set[str]:
    config = configparser.ConfigParser()
    config.read(ROOT / ".importlinter")
    layers = config["importlinter:contract:layers"]["layers"]
    return {name.strip() for line in layers.splitlines() for name in re.split(r"[:|]", line) if name.strip()}


def test_every_module_is_in_a_layer():
    """Each top-level package or module of ds_ext is a layer, or (a package split over layers, as
    ds_ext.integration is) each of its modules is: a new package cannot slip outside the layers.
    ``ds_ext/autoload`` is no package (a sys.path entry for its ``sitecustomize``)."""
    layered = _layer_modules()
    missing = []
    for top in pkgutil.iter_modules([str(ROOT / "ds_ext")]):
        name = f"ds_ext.{top.name}"
        if name in layered:
            continue
        subs = (
            [f"{name}.{m.name}" for m in pkgutil.iter_modules([str(ROOT / "ds_ext" / top.name)])] if top.ispkg else []
        )
        missing += [s for s in subs if s not in layered] if subs and any(s in layered for s in subs) else [name]
    assert missing == [], f"not in any layer of .importlinter: {missing}"
