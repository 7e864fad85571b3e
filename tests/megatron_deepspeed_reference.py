"""Megatron-DeepSpeed's ``pretrain_gpt.py`` under plain DeepSpeed (no ds_ext): the reference of
whole experts in tests/test_megatron_deepspeed_ted.py (DeepSpeed's own ``MOELayer``, duplicate
tokens dropped and gathered by its ``moe/mappings.py``).

Usage (the client's directory as working directory; examples/megatron_deepspeed_ted.sh ... deepspeed)::

    torchrun --nproc_per_node 4 tests/megatron_deepspeed_reference.py pretrain_gpt.py ARGS...

One change to DeepSpeed, for gloo: :func:`ds_ext.integration.ds_moe.flat_gather_tokens` hands
DeepSpeed's token all-gather its input flattened (NCCL takes the N-d input, gloo does not); the
bytes and the result are DeepSpeed's. TED does not use that function.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

if __name__ == "__main__":
    import deepspeed.ops

    from ds_ext.integration.ds_moe import flat_gather_tokens

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # unused on CPU, a 1-min JIT build otherwise
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path.insert(0, str(Path(script).resolve().parent))
    with flat_gather_tokens():
        runpy.run_path(script, run_name="__main__")
