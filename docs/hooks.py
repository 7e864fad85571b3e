"""MkDocs hook: publish the benchmark figures of ``examples/results`` with the site.

The pages link them as ``examples/results/NAME.png`` relative to the documentation root, so the
images live in one place (next to their JSON) and are never copied into ``docs/``.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parent.parent


def on_files(files, config):
    for png in sorted((ROOT / "examples" / "results").rglob("*.png")):
        files.append(File(str(png.relative_to(ROOT)), str(ROOT), config["site_dir"], config["use_directory_urls"]))
    return files
