"""ds_ext for scripts that call ``deepspeed.initialize`` themselves, with no edit.

GPT-NeoX, Megatron-DeepSpeed, Hugging Face and most DeepSpeed scripts call
``deepspeed.initialize`` directly, and DeepSpeed keeps an unknown top-level ``"ds_ext"``
block without a word. Two ways in:

* :func:`patch_deepspeed` (active): ``deepspeed.initialize`` becomes a dispatcher; a
  config that holds a ``"ds_ext"`` block (given as ``config=``, ``config_params=`` or
  ``args.deepspeed_config``: a dict, a JSON/hjson path or a base64 string) goes through
  :func:`ds_ext.initialize`, any other goes to DeepSpeed untouched; if the command line's
  ``--deepspeed_config`` enables TED, ``deepspeed.moe.layer.MoE`` becomes TEDMoE
  (:mod:`ds_ext.entry.moe_substitution`). ``python -m
  ds_ext.run script.py ...`` patches and then runs the script (``ds_ext/run.py``).
* :func:`unpatch_deepspeed` switches routing off again: from then on a direct
  ``deepspeed.initialize`` with a ``"ds_ext"`` block warns that the block is ignored and
  how to activate it. Importing ds_ext alone wraps nothing and installs no import hook.

Behind the version gate of :mod:`ds_ext.integration.ds_version`.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import inspect
import sys
from typing import Any, Callable

from ds_ext import log
from ds_ext.integration import ds_initialize

_ACTIVE = False

IGNORED = (
    'the "ds_ext" block of this ds_config is ignored: deepspeed.initialize was called directly. Run the script '
    "under `python -m ds_ext.run` (`deepspeed --module ds_ext.run script.py ...`), call ds_ext.patch_deepspeed() "
    "first, or call ds_ext.initialize"
)


def _has_ds_ext_block(arguments: dict) -> bool:
    from ds_ext import config as cfgmod
    from ds_ext.entry.initialize import _resolve_config

    try:
        resolved = _resolve_config(arguments.get("args"), arguments.get("config"), arguments.get("config_params"))
    except ValueError:
        return False  # no config: DeepSpeed reports it itself
    try:
        return cfgmod.BLOCK in cfgmod.load_ds_config(resolved)
    except cfgmod.ConfigNotFoundError:
        return False  # DeepSpeed reports a missing config itself


def _dispatcher(original: Callable) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def initialize(*args: Any, **kwargs: Any):
        arguments = signature.bind(*args, **kwargs).arguments  # DeepSpeed's positional order
        if not _has_ds_ext_block(arguments):
            return original(*args, **kwargs)
        if _ACTIVE:
            from ds_ext.entry.initialize import initialize as ds_ext_initialize

            return ds_ext_initialize(**arguments)
        log.warn(IGNORED)
        return original(*args, **kwargs)

    initialize.__ds_ext_dispatcher__ = True  # type: ignore[attr-defined]
    return initialize


def _wrap(deepspeed_module: Any) -> None:
    ds_initialize.wrap(deepspeed_module, _dispatcher)


def patch_deepspeed() -> None:
    """Route ``deepspeed.initialize`` through ds_ext for configs with a ``"ds_ext"`` block
    (idempotent; :func:`unpatch_deepspeed` switches it back to reporting)."""
    global _ACTIVE
    import deepspeed

    from ds_ext.integration.ds_version import check_version

    check_version()
    _wrap(deepspeed)
    _ACTIVE = True
    _substitute_moe()


def _substitute_moe() -> None:
    """TEDMoE for ``deepspeed.moe.layer.MoE`` when the command line's ds_config enables TED
    (:mod:`ds_ext.entry.moe_substitution`)."""
    from ds_ext.entry.moe_substitution import substitute_from_argv

    substitute_from_argv()


def activate_on_import() -> None:
    """:func:`patch_deepspeed` without importing DeepSpeed now: it takes effect when the
    script imports it (``ds_ext/autoload/sitecustomize.py`` calls this at interpreter
    start, for launchers that build the rank command themselves, e.g. GPT-NeoX's deepy)."""
    global _ACTIVE
    _ACTIVE = True
    watch()


def unpatch_deepspeed() -> None:
    """Stop routing through ds_ext; an ignored ``"ds_ext"`` block is reported again."""
    global _ACTIVE
    _ACTIVE = False


def active() -> bool:
    return _ACTIVE


class _WatchDeepSpeedImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Wraps ``deepspeed.initialize`` right after ``import deepspeed`` runs."""

    def find_spec(self, name, path, target=None):
        if name != "deepspeed":
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        self._loader = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        sys.meta_path[:] = [f for f in sys.meta_path if f is not self]
        self._loader.exec_module(module)
        _wrap(module)
        if _ACTIVE:
            _substitute_moe()


def watch() -> None:
    """Wrap ``deepspeed.initialize`` now if DeepSpeed is imported, else as soon as it is (no
    DeepSpeed import here; called on activation only)."""
    if "deepspeed" in sys.modules and hasattr(sys.modules["deepspeed"], "initialize"):
        _wrap(sys.modules["deepspeed"])
    elif not any(isinstance(f, _WatchDeepSpeedImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _WatchDeepSpeedImport())
