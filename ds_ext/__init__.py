"""ds_ext: topology-aware extensions for DeepSpeed (ZeRO-topo, TED MoE, tiled optimizer, 3D-PMM).

Entry point: :func:`ds_ext.initialize`, a drop-in for ``deepspeed.initialize`` that reads
the top-level ``"ds_ext"`` block of the ds_config.
"""

__version__ = "0.1.0"


def initialize(*args, **kwargs):
    """See :func:`ds_ext.integration.initialize.initialize` (imported lazily: DeepSpeed is heavy)."""
    from ds_ext.integration.initialize import initialize as _initialize

    return _initialize(*args, **kwargs)


__all__ = ["initialize", "__version__"]
