"""Activate ds_ext in every Python process started with this directory on PYTHONPATH.

``export PYTHONPATH=$(ds-ext autoload-path):$PYTHONPATH`` makes Python import this module
at start (``site`` imports the first ``sitecustomize`` on the path), so scripts whose
launcher builds the rank command itself (GPT-NeoX's ``deepy.py``, a site's wrapper) get
ds_ext with no code change: ``deepspeed.initialize`` goes through ds_ext when its config
holds a ``"ds_ext"`` block (``ds_ext.entry.activation.activate_on_import``; DeepSpeed
is not imported here). A ``sitecustomize`` this one shadows still runs.
"""

import importlib.util
import os
import sys


def _chain() -> None:
    """Run the next ``sitecustomize`` on the path (the one this directory shadows)."""
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if os.path.abspath(entry or ".") == here:
            continue
        candidate = os.path.join(entry or ".", "sitecustomize.py")
        if os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_site_sitecustomize", candidate)
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


from ds_ext.entry.activation import activate_on_import  # noqa: E402

activate_on_import()
_chain()
