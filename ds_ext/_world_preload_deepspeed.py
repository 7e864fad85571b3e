"""For :func:`ds_ext.local_world.preload`: DeepSpeed (about 0.5 s of CPU per process) and
ds_ext's DeepSpeed integration, imported once in the forkserver, for processes whose worlds'
ranks all use the installed DeepSpeed (a rank that must choose its DeepSpeed, as
tests/test_tiled_optimizer_releases.py, needs a process that does not preload it).

DeepSpeed picks its accelerator when imported: the CPU one, as the World's
``DS_ACCELERATOR=cpu`` makes a rank pick it, unless the environment names another.
"""

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402,F401
import deepspeed.ops  # noqa: E402

import ds_ext.entry.initialize  # noqa: E402,F401
from ds_ext.runtime import builtin_plugins  # noqa: E402

# the op builders' compatibility probe, which DeepSpeed runs on first use (init_distributed reads
# it): a compiler run per op, about 0.5 s of CPU and a child process for every rank otherwise
deepspeed.ops.__compatible_ops__  # noqa: B018
builtin_plugins()  # every built-in plugin module (goldfish, samo, TED's layers, ...); ds_ext.config their sections

try:  # DeepSpeed imports it in ZeRO's optimizer check (stage >= 1); it builds a torch.compile wrapper (~1 s)
    import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401
except ImportError:
    pass
