"""DeepSpeed engine, launcher and checkpoint touch points (read in DeepSpeed 0.19.8).

Behind the version gate of :mod:`ds_ext.integration.ds_version`.
"""

from __future__ import annotations

import functools
import os
import sys
from datetime import timedelta

import torch.distributed as dist

from ds_ext.integration.ds_version import check_version
from ds_ext.topology import slurm_rank_variables

check_version()


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

    disable_jit_builds()
    kwargs = {}
    if timeout_s is not None:
        kwargs["timeout"] = timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        os.environ.update(slurm_rank_variables())  # srun tasks: SLURM_PROCID -> RANK, ...
        missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
        if missing:
            raise RuntimeError(
                f"torch.distributed is not initialized and {', '.join(missing)} are unset: "
                "start the script with the deepspeed launcher, torchrun or srun "
                "(see launch/; under srun the batch script sets MASTER_ADDR / MASTER_PORT), "
                "or call torch.distributed.init_process_group first"
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


