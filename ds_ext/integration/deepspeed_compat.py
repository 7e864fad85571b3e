"""Every touch of DeepSpeed internals, in one version-checked module.

DeepSpeed has no plugin hooks (spec/deepspeed_on_cpu.md §3.8), so ds_ext reaches a few
private names. They were read in DeepSpeed 0.19.8; :func:`check_version` refuses other
minor versions with a clear error instead of failing deep inside a patched function.
"""

from __future__ import annotations

import functools
import os
import sys
from datetime import timedelta

import torch.distributed as dist
from packaging.version import Version

SUPPORTED = (Version("0.19.0"), Version("0.20.0"))  # [min, max)


def check_version() -> str:
    """Return DeepSpeed's version, or raise if ds_ext does not support it."""
    import deepspeed

    v = Version(deepspeed.__version__.split("+")[0])
    lo, hi = SUPPORTED
    if not lo <= v < hi:
        raise RuntimeError(
            f"ds_ext supports deepspeed>={lo},<{hi}; found deepspeed {deepspeed.__version__}"
        )
    return deepspeed.__version__


def disable_jit_builds() -> None:
    """Skip the shared-memory op DeepSpeed JIT-compiles in ``init_distributed``.

    The op (``deepspeed_shm_comm``, ~1 min of g++ on first use) serves only inference
    all-reduce; ``comm/torch.py:build_shm_op`` consults ``ops.__compatible_ops__``.
    """
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def rebind_backend_collectives() -> None:
    """Make DeepSpeed's comm backend call the current torch.distributed functions.

    ``TorchBackend.__init__`` caches ``all_gather_into_tensor`` and
    ``reduce_scatter_tensor`` (comm/torch.py:210-211); after ds_ext wraps
    torch.distributed for the ledger, the cache must point at the wrappers.
    """
    cdb = sys.modules["deepspeed.comm.comm"].cdb
    if cdb is None:
        return
    cdb.all_gather_function = type(cdb).get_all_gather_function()
    cdb.reduce_scatter_function = type(cdb).get_reduce_scatter_function()


def init_distributed(
    dist_init_required: bool | None = None, timeout_s: float | None = None
) -> None:
    """``deepspeed.init_distributed`` on the accelerator's backend, without JIT builds."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    check_version()
    disable_jit_builds()
    kwargs = {}
    if timeout_s is not None:
        kwargs["timeout"] = timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
        if missing:
            raise RuntimeError(
                f"torch.distributed is not initialized and {', '.join(missing)} are unset: "
                "start the script with the deepspeed launcher, torchrun or srun "
                "(see launch/), or call torch.distributed.init_process_group first"
            )
    deepspeed.init_distributed(
        dist_backend=get_accelerator().communication_backend_name(),
        dist_init_required=dist_init_required,
        auto_mpi_discovery=False,
        **kwargs,
    )


def replace_optimizer(engine, optimizer) -> None:
    """Make ``engine.step()`` call ``optimizer`` and stop DeepSpeed's own gradient all-reduce.

    Stage-0 engines keep the client optimizer in ``engine.optimizer`` and all-reduce grads
    in ``_backward_epilogue`` / at the boundary while ``enable_backward_allreduce`` is set
    (runtime/engine.py:3163, 3602); ``_take_model_step`` reads ``optimizer.overflow``.
    """
    engine.optimizer = optimizer
    engine.enable_backward_allreduce = False


def scale_backward_loss(engine, scale) -> None:
    """Multiply the loss by ``scale()`` in ``engine.backward`` (fp16 loss scaling)."""
    backward = engine.backward

    @functools.wraps(backward)
    def scaled(loss, *args, **kwargs):
        return backward(loss * scale(), *args, **kwargs)

    engine.backward = scaled


def wrap_checkpointing(engine, save_shard, load_shard, sharded) -> None:
    """Add per-rank shard files to ``engine.save_checkpoint`` / ``load_checkpoint``.

    DeepSpeed's stage-0 checkpoint writes ``module.state_dict()`` from rank 0
    (engine.py:5390-5404) and calls it on every rank, so the sharded weights are
    gathered around the call; each rank then writes / reads its own shard file in the
    tag directory.
    """
    save, load = engine.save_checkpoint, engine.load_checkpoint

    @functools.wraps(save)
    def save_checkpoint(save_dir, tag=None, *args, **kwargs):
        tag = f"global_step{engine.global_steps}" if tag is None else tag
        sharded.gather_all()
        try:
            out = save(save_dir, tag, *args, **kwargs)
        finally:
            sharded.release_all()
        save_shard(os.path.join(save_dir, str(tag)))
        dist.barrier()
        return out

    @functools.wraps(load)
    def load_checkpoint(load_dir, tag=None, *args, **kwargs):
        sharded.gather_all()
        try:
            path, client_state = load(load_dir, tag, *args, **kwargs)
            if path is not None:
                for unit in sharded.all_units:
                    unit.adopt_full()
        finally:
            sharded.release_all()
        if path is not None:
            load_shard(os.path.dirname(path))
        return path, client_state

    engine.save_checkpoint = save_checkpoint
    engine.load_checkpoint = load_checkpoint


def enable_cpu_zeropp_quantizer() -> None:
    """Let DeepSpeed's own ZeRO++ (qwZ / qgZ) run on CPU, for the benchmark baseline.

    DeepSpeed's CUDA quantizer has no CPU build (spec/deepspeed_on_cpu.md §2); 0.19.8 ships
    a pure-torch ``NPUQuantizer`` with the same wire format. Route ``QuantizerBuilder`` to
    it (both call sites resolve the name at call time: partition_parameters.py:865,
    coalesced_collectives.py:34), flatten the ``[groups, 1]`` scales of ``quantize`` (gloo
    rejects an N-d input with a flat output) and round to nearest as the CUDA kernels do
    (``__float2int_rn``) instead of the NPU reference's truncation. Process-wide; meant
    for the ``ds-ext bench zero`` worker processes only.
    """
    import deepspeed.ops.op_builder as op_builder
    from deepspeed.ops.op_builder.npu.quantizer import NPUQuantizer

    check_version()

    def quantize_groups_rn(xg, num_bits):
        maxv = xg.abs().max(dim=1).values
        scale = float(1 << num_bits) / (2.0 * maxv)
        scale.masked_fill_(maxv == 0, 1.0)
        lim = 1 << (num_bits - 1)
        xg.mul_(scale.view(-1, 1)).round_().clamp_(-lim, lim - 1)
        return xg, scale.reciprocal().view(-1)

    class CpuQuantizer(NPUQuantizer):
        @staticmethod
        def quantize(input_vals, groups, num_bits, quant_type):
            q, scales = NPUQuantizer.quantize(input_vals, groups, num_bits, quant_type)
            return q, scales.view(-1)

    class CpuQuantizerBuilder:
        def load(self, verbose: bool = True):
            return CpuQuantizer

    NPUQuantizer._quantize_groups = staticmethod(quantize_groups_rn)
    op_builder.QuantizerBuilder = CpuQuantizerBuilder


def deepspeed_zero3_state_bytes(engine) -> dict[str, int]:
    """Bytes one rank holds per model state under DeepSpeed's ZeRO-3 optimizer (0.19.8
    attribute names): ``ds_tensor`` / ``ds_secondary_tensor`` partitions, the flat gradient
    partition buffer, fp32 master partitions plus the inner optimizer's state."""
    opt = engine.optimizer
    nbytes = lambda t: 0 if t is None else t.numel() * t.element_size()  # noqa: E731
    params = list(engine.module.parameters())
    inner = sum(
        nbytes(v) for st in opt.optimizer.state.values() for v in st.values() if getattr(v, "dim", lambda: 0)()
    )
    return {
        "primary": sum(nbytes(p.ds_tensor) for p in params),
        "secondary": sum(nbytes(getattr(p, "ds_secondary_tensor", None)) for p in params),
        "gradients": nbytes(opt.grad_partitions_flat_buffer),
        "optimizer": sum(nbytes(t) for t in opt.fp32_partitioned_groups_flat) + inner,
    }
