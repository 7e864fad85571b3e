"""3D-PMM: AxoNN's 4D hybrid parallelism (X x Y x Z tensor grid + data), 001 ch. 5, 000 §V."""

from ds_ext.pmm.engine import PMMEngine
from ds_ext.pmm.grid import Axis, Grid, GridError, build_axes
from ds_ext.pmm.layers import Embedding, Head, LayerNorm, RMSNorm
from ds_ext.pmm.linear import Linear
from ds_ext.pmm.parallelize import ConversionError, local_shards, parallelize
from ds_ext.pmm.plans import LinearStyle, Plan, plan_for

__all__ = [
    "Axis",
    "ConversionError",
    "Embedding",
    "Grid",
    "GridError",
    "Head",
    "LayerNorm",
    "Linear",
    "LinearStyle",
    "PMMEngine",
    "Plan",
    "RMSNorm",
    "build_axes",
    "local_shards",
    "parallelize",
    "plan_for",
]
