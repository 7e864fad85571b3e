"""Imported once by the forkserver that :class:`ds_ext.local_world.World` forks its ranks
from, so that every rank starts with what nearly every rank imports: torch, torch.distributed
and torch._dynamo (which torch imports on the first optimizer's construction), about 3 s of
CPU per process; and ds_ext's own modules that import neither DeepSpeed nor anything else
heavy (their pydantic config models take a few hundred ms to build). More modules:
:func:`ds_ext.local_world.preload`. DeepSpeed is not
imported here: a rank may choose which DeepSpeed it imports
(tests/test_tiled_optimizer_releases.py; tests/test_local_world.py checks that a rank starts
without it).

Only imports, no computation: the forkserver must hold no thread when it forks.
``OMP_NUM_THREADS=1`` before torch loads its OpenMP runtime keeps it so (and is what every
rank gets from the World's environment anyway; ranks also call ``torch.set_num_threads(1)``).
"""

import importlib
import os
import warnings

os.environ["OMP_NUM_THREADS"] = "1"
warnings.filterwarnings("ignore", category=FutureWarning)

import torch  # noqa: E402,F401
import torch._dynamo  # noqa: E402,F401
import torch.distributed  # noqa: E402,F401

DS_EXT_MODULES = (
    "ds_ext.config",
    "ds_ext.runtime",
    "ds_ext.plugin",
    "ds_ext.comm.instrument",
    "ds_ext.comm.quantized",
    "ds_ext.zero_topo.plugin",
    "ds_ext.zero_topo.checkpoint",
    "ds_ext.optim.plugin",
    "ds_ext.pmm.plugin",
    "ds_ext.moe.plugin",
    "ds_ext.pccl.plugin",
    "ds_ext.models.gpt",
    "ds_ext.data",
)
for _name in DS_EXT_MODULES:
    try:
        importlib.import_module(_name)
    except Exception:  # a rank that needs it raises the error itself
        pass
