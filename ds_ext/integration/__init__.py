"""DeepSpeed integration: ``initialize`` and DeepSpeed's private touch points, one module per surface behind one version gate (ds_version)."""

from ds_ext.integration.initialize import initialize

__all__ = ["initialize"]
