"""ds_ext: topology-aware extensions for DeepSpeed (ZeRO-topo, TED MoE, tiled optimizer, 3D-PMM).

Entry points: :func:`ds_ext.initialize`, a drop-in for ``deepspeed.initialize`` that reads
the top-level ``"ds_ext"`` block of the ds_config; :func:`ds_ext.patch_deepspeed` (or
``python -m ds_ext.run script.py``) for scripts that call ``deepspeed.initialize``
themselves. Importing ds_ext makes a direct ``deepspeed.initialize`` with a ``"ds_ext"``
block warn that the block is ignored (``ds_ext.integration.activation``).
"""

__version__ = "0.1.0"


def initialize(*args, **kwargs):
    """See :func:`ds_ext.integration.initialize.initialize` (imported lazily: DeepSpeed is heavy)."""
    from ds_ext.integration.initialize import initialize as _initialize

    return _initialize(*args, **kwargs)


def patch_deepspeed() -> None:
    """See :func:`ds_ext.integration.activation.patch_deepspeed`."""
    from ds_ext.integration.activation import patch_deepspeed as _patch

    _patch()


def unpatch_deepspeed() -> None:
    """See :func:`ds_ext.integration.activation.unpatch_deepspeed`."""
    from ds_ext.integration.activation import unpatch_deepspeed as _unpatch

    _unpatch()


def _watch() -> None:
    from ds_ext.integration.activation import watch

    watch()


_watch()

__all__ = ["initialize", "patch_deepspeed", "unpatch_deepspeed", "__version__"]
