"""DeepSpeed integration: ``initialize`` and the version-checked compat layer."""

from ds_ext.integration.initialize import initialize

__all__ = ["initialize"]
