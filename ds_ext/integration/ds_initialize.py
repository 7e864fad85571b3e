"""DeepSpeed's own ``deepspeed.initialize``, kept when activation wraps it.

:mod:`ds_ext.entry.activation` wraps ``deepspeed.initialize`` (:func:`wrap`);
:mod:`ds_ext.entry.initialize` calls the original after the plugins
(:func:`deepspeed_initialize`). No DeepSpeed import when this module is imported:
activation runs at interpreter start through the autoload directory.
"""

from __future__ import annotations

from typing import Any, Callable

_ORIGINAL: Callable | None = None  # DeepSpeed's own initialize, once wrapped


def wrap(deepspeed_module: Any, dispatcher: Callable[[Callable], Callable]) -> None:
    """``deepspeed_module.initialize`` becomes ``dispatcher(original)``, once."""
    global _ORIGINAL
    if _ORIGINAL is None:
        _ORIGINAL = deepspeed_module.initialize
        deepspeed_module.initialize = dispatcher(_ORIGINAL)


def deepspeed_initialize() -> Callable:
    """DeepSpeed's own ``initialize`` (what ds_ext calls after its plugins)."""
    import deepspeed

    return _ORIGINAL if _ORIGINAL is not None else deepspeed.initialize
