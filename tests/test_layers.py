"""The layers hold, every package of ds_ext is in one as a whole, no module of ds_ext imports
itself through others, and the plugin contract imports no plugin.

``.importlinter`` states the layers (cli > bench > tools > entry > runtime > config schema >
plugins > models > base plugins > perf / plugin contract > DeepSpeed touch points > comm > groups >
parallel > topology and leaves > errors; docs/architecture.md) and keeps the schema
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


def test_every_package_is_one_layer_entry():
    """Each top-level package or module of ds_ext is named in one layer, and every name there is a
    whole top-level package or module (no package split over layers): a new package cannot slip
    outside the layers. ``ds_ext/autoload`` is no package (a sys.path entry for its ``sitecustomize``)."""
    layered = _layer_modules()
    tops = {f"ds_ext.{m.name}" for m in pkgutil.iter_modules([str(ROOT / "ds_ext")])}
    assert sorted(tops - layered) == [], "not in any layer of .importlinter"
    assert sorted(layered - tops) == [], "layer names that are not a whole top-level package or module"


def test_the_plugin_contract_imports_no_plugin():
    """``ds_ext/plugin.py`` (a low layer) imports no plugin and loads no module by name: the
    built-ins are listed where they are used (``ds_ext.config``, ``ds_ext.runtime``)."""
    import ast

    tree = ast.parse((ROOT / "ds_ext" / "plugin.py").read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    allowed = {"__future__", "typing", "pydantic", "ds_ext.config_base", "ds_ext.errors", "ds_ext.parallel"}
    assert sorted(imported - allowed) == []


PLUGIN_PACKAGES = {
    "zero_topo": "zero_topo",
    "pmm": "pmm3d",
    "pccl": "pccl",
    "goldfish": "goldfish",
    "samo": "samo",
    "moe": "ted",
    "optim": "tiled_optimizer",
}


def test_plugins_know_each_other_by_capabilities_not_names():
    """No built-in plugin's code compares another plugin's name or looks one up by it
    (``p.name == "zero_topo"``, ``runtime.plugin("ted")``): what one asks of another is a capability
    of the contract (``owns_step``, ``shards_parameters``, ``builds_model_parallel``, ``use_tiles``).
    Names in error messages are words, not lookups, and are allowed."""
    import ast

    from ds_ext.config import BUILTIN_SECTIONS

    assert set(PLUGIN_PACKAGES.values()) == set(BUILTIN_SECTIONS)
    found = []
    for package, own in PLUGIN_PACKAGES.items():
        others = set(BUILTIN_SECTIONS) - {own}
        for path in sorted((ROOT / "ds_ext" / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Compare):  # ... .name == "ted", ... .name in ("ted", ...)
                    operands = [node.left, *node.comparators]
                    if not any(isinstance(o, ast.Attribute) and o.attr == "name" for o in operands):
                        continue
                elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "plugin":
                    operands = node.args  # runtime.plugin("ted")
                else:
                    continue
                operands += [e for o in operands if isinstance(o, (ast.Tuple, ast.List, ast.Set)) for e in o.elts]
                names = {o.value for o in operands if isinstance(o, ast.Constant)} & others
                found += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in sorted(names)]
    assert found == []
