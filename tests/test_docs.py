"""The documentation (docs/, README.md; no processes).

* every generated page (configuration reference from the schema, API reference, benchmark tables
  from examples/results/*.json) equals what ``python -m docs.gen`` produces now;
* every relative link and image of the README names a file or folder of the repository, and the
  README stays a short front page;
* the site builds with ``mkdocs build --strict`` (warnings are errors), skipped where MkDocs and
  its plugins are not installed.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _gen():
    spec = importlib.util.spec_from_file_location("docs_gen", ROOT / "docs" / "gen.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_pages_equal_their_generators():
    stale = [str(p.relative_to(ROOT)) for p in _gen().stale()]
    assert not stale, f"generated pages out of date (run: python -m docs.gen): {stale}"


def test_readme_links_resolve():
    text = README.read_text()
    targets = [t for t in LINK.findall(text) if not re.match(r"^[a-z]+:", t) and not t.startswith("#")]
    assert targets, "the README links into the docs"
    missing = [t for t in targets if not (ROOT / t.split("#")[0]).exists()]
    assert not missing, f"README links to files that do not exist: {missing}"


def test_readme_is_a_short_front_page():
    lines = README.read_text().count("\n")
    assert lines <= 250, f"README.md has {lines} lines; move detail into docs/ (docs/contributing.md)"


def test_readme_keeps_the_two_commands():
    text = README.read_text()
    assert "pip install -q -r requirements-dev.txt && launch/local_cpu.sh 8 configs/demo.json --steps 30" in text
    assert "pip install -q -r requirements-dev.txt && python -m pytest -q" in text
    assert "pip install -q -r requirements-dev.txt && python -m pytest -q" in (ROOT / ".ci" / "run").read_text()


def test_mkdocs_build_strict(tmp_path):
    missing = [
        m
        for m in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python")
        if importlib.util.find_spec(m.split(".")[0]) is None
    ]
    if missing:
        pytest.skip(f"documentation tools not installed ({', '.join(missing)}): pip install -r requirements-dev.txt")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_no_tracker_issue_numbers_in_code_or_docs():
    """Code, tests and docs say what they mean, not which tracker issue asked for it (a reference to
    another project's tracker is written ``owner/repo#N``). The committed measurements under
    examples/results/ keep their records as they were made."""
    import re
    import subprocess

    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    pattern = re.compile(r"\b[Ii]ssues? #?\d+")
    found = []
    for name in files:
        path = ROOT / name
        if name.startswith("examples/results/") or not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        found += [f"{name}:{text.count(chr(10), 0, m.start()) + 1}" for m in pattern.finditer(text)]
    assert found == []
