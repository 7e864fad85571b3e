"""Imported once by the forkserver that :class:`ds_ext.local_world.World` forks its ranks
from, so that every rank starts with torch imported: torch itself, torch.distributed and
torch._dynamo (which torch imports on the first optimizer's construction) cost about 3 s of
CPU per process, most of a world's start on a small machine. DeepSpeed is not imported here:
a rank may choose which DeepSpeed it imports (tests/test_tiled_optimizer_releases.py).

Only imports, no computation: the forkserver must hold no thread when it forks.
``OMP_NUM_THREADS=1`` before torch loads its OpenMP runtime keeps it so (and is what every
rank gets from the World's environment anyway; ranks also call ``torch.set_num_threads(1)``).
"""

import os
import warnings

os.environ["OMP_NUM_THREADS"] = "1"
warnings.filterwarnings("ignore", category=FutureWarning)

import torch  # noqa: E402,F401
import torch._dynamo  # noqa: E402,F401
import torch.distributed  # noqa: E402,F401
