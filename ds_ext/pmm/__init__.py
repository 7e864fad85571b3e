"""3D-PMM: AxoNN's 4D hybrid parallelism (X x Y x Z tensor grid + data), 001 ch. 5, 000 §V.

The names below load on first use (PEP 562), so that the torch-free modules of this package
(``grid``, ``layout``, ``config``, ``tune``) import without torch: the planner uses them.
"""

import sys
import types
from typing import Any

from ds_ext.lazy import lazy_exports

_EXPORTS = {
    "Axis": "ds_ext.pmm.grid",
    "ConversionError": "ds_ext.pmm.plans",
    "Embedding": "ds_ext.pmm.vocab",
    "FullCheckpoint": "ds_ext.pmm.full_checkpoint",
    "Grid": "ds_ext.parallel",
    "GridError": "ds_ext.parallel",
    "LayerNorm": "ds_ext.pmm.layers",
    "Linear": "ds_ext.pmm.linear",
    "LinearStyle": "ds_ext.pmm.plans",
    "MetaBuildError": "ds_ext.pmm.init_replay",
    "PMMEngine": "ds_ext.pmm.engine",
    "Plan": "ds_ext.pmm.plans",
    "RMSNorm": "ds_ext.pmm.layers",
    "build_axes": "ds_ext.pmm.grid",
    "build_on_meta": "ds_ext.pmm.meta",
    "local_shards": "ds_ext.pmm.parallelize",
    "materialize": "ds_ext.pmm.meta",
    "parallelize": "ds_ext.pmm.parallelize",
    "plan_for": "ds_ext.pmm.plans",
    "vocab_cross_entropy": "ds_ext.pmm.vocab",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)


class _Package(types.ModuleType):
    """``parallelize`` is a submodule and its function: importing the submodule binds the package's
    attribute to the function, as an eager ``from ds_ext.pmm.parallelize import parallelize`` did."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and _EXPORTS.get(name) == value.__name__:
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
