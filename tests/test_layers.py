"""The layers of DESIGN.md §1 hold and no module of ds_ext imports itself through others.

``.importlinter`` states the layers (cli > activation > initialize > runtime > config schema >
plugins > plugin contract > comm > groups > topology) and keeps the schema torch-free;
``lint-imports`` checks it on this checkout. Import cycles count every import: at module top,
inside functions and under ``TYPE_CHECKING`` (a function-level import that only dodges a cycle
is still one).
"""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def test_import_contracts_kept():
    run = subprocess.run(
        [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
         "sys.exit(lint_imports_command())", "--no-cache", "--config", str(ROOT / ".importlinter")],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300,
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
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=_env(), capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout == "", "import cycles:\n" + run.stdout
