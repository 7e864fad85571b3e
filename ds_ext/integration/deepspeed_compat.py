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

from ds_ext.topology import slurm_rank_variables

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


# ---- tiled optimizer (001 §7.2): DeepSpeed's mixed-precision wrappers -------------------
def optimizer_kind(optimizer) -> str:
    """What wraps the client optimizer in a DeepSpeed engine.

    ``"zero12"`` = ``DeepSpeedZeroOptimizer`` (ZeRO 1/2, fp32/fp16/bf16),
    ``"unfused16"`` = ``FP16_UnfusedOptimizer`` (stage 0 with fp16, and with bf16:
    engine.py:2321 maps bf16 without ZeRO to DDP_BFLOAT16, which builds this wrapper
    around a torch optimizer), ``"plain"`` = the torch optimizer itself (stage 0 fp32),
    else the wrapper's class name.
    """
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if isinstance(optimizer, DeepSpeedZeroOptimizer):
        return "zero12"
    if isinstance(optimizer, FP16_UnfusedOptimizer):
        return "unfused16"
    import torch

    if isinstance(optimizer, torch.optim.Optimizer) and not hasattr(optimizer, "optimizer"):
        return "plain"
    return type(optimizer).__name__


def _refuse(what: str) -> None:
    from ds_ext.config import DsExtConfigError

    raise DsExtConfigError(
        f"ds_ext.tiled_optimizer: not supported together with {what}; supported: ZeRO stage 0, 1 or 2 "
        "(fp32, fp16 or bf16) without offload, or ds_ext.zero_topo"
    )


def install_tiled_zero_step(zero_opt, tiled) -> None:
    """Replace ``DeepSpeedZeroOptimizer.step`` by the tiled step (001 §7.2).

    Mirrors ``stage_1_and_2.py:step`` (0.19.8, l.3013-3191, non-offload branch) and reuses
    its overflow check, global norm (incl. MoE expert-norm averaging), loss-scale update and
    ``unscale_and_clip_grads``; only the per-group "flatten, ``.to(fp32)``, optimizer step,
    copy to 16-bit" is replaced by :meth:`ds_ext.optim.tiled.TiledAdam.update` reading the
    partition's 16-bit gradient pieces (``averaged_gradients[i]``) tile by tile.
    """
    import torch
    from deepspeed import comm as ds_dist

    z = sys.modules["deepspeed.runtime.zero.stage_1_and_2"]
    from ds_ext.optim.tiled import piecewise_loader

    if zero_opt.cpu_offload:
        _refuse("zero_optimization.offload_optimizer")
    if zero_opt.zenflow:
        _refuse("zenflow")
    if zero_opt.torch_autocast_gradscaler is not None:
        _refuse("torch_autocast")
    self = zero_opt

    def group_update(i: int, norm) -> None:
        partition_id = ds_dist.get_rank(group=self.real_dp_process_group[i])
        self.free_grad_in_param_list(self.params_not_in_partition[i])
        pre = self._get_preflattened_grad_partition(i)
        pieces = [pre] if pre is not None else list(self.averaged_gradients[i])
        if self._muon_update_lacks_loss_scale(i):
            _refuse("Muon")
        fp32 = self.single_partition_of_fp32_groups[i]
        bit16 = self.parallel_partitioned_bit16_groups[i][partition_id]
        load = piecewise_loader(
            pieces, int(self.partition_size[i]), lambda buf: self.unscale_and_clip_grads([buf], norm)
        )

        def store(s: int, e: int) -> None:
            bit16.data[s:e].copy_(fp32.data[s:e])

        tiled.update(fp32, self.optimizer.param_groups[i], load, store)
        self.free_grad_in_param_list(self.params_in_partition[i])
        self._release_preflattened_grad_buffers(i)
        self.averaged_gradients[i] = None
        self.all_grad_tensors[i] = None

    @torch.no_grad()
    def step(closure=None):
        if closure is not None:
            raise ValueError("ds_ext.tiled_optimizer: step(closure) is not supported")
        self.micro_step_id = z.INITIAL_MICRO_STEP_ID
        if not self.compute_grad_norm:
            self._global_grad_norm = None
        # 1. overflow and global norm, before any tile is touched
        self.overflow = False
        if self.check_grad_overflow:
            self.check_overflow(partition_gradients=self.partition_gradients)
        norm = None
        if self.compute_grad_norm and not self.overflow:
            norm = self.scaled_global_norm()
            if (self.dtype != torch.bfloat16 or self.check_grad_overflow) and z.is_invalid_grad_norm(norm):
                self.overflow = True
        prev_scale = self.loss_scale
        self._update_scale(self.overflow)
        if self.overflow:
            if self.compute_grad_norm:
                self._global_grad_norm = float("inf")
            self.zero_grad(set_to_none=True)
            self._release_preflattened_grad_buffers()
            for k in self.averaged_gradients.keys():
                self.averaged_gradients[k] = None
                self.all_grad_tensors[k] = None
            for timer in z.OPTIMIZER_TIMERS:
                self.timers(timer).start()
                self.timers(timer).stop()
            return
        if norm is not None:
            self._global_grad_norm = norm / prev_scale
        # 2. tiled up-cast, unscale/clip, update, copy back
        self.timers(z.OPTIMIZER_STEP_TIMER).start()
        for i in range(len(self.bit16_groups)):
            group_update(i, norm)
        tiled.end_step()
        self._lazy_init_hp_params_optimizer_state()
        self.timers(z.OPTIMIZER_STEP_TIMER).stop()
        # 3. DeepSpeed's weight all-gather, unchanged
        self.timers(z.OPTIMIZER_ALLGATHER_TIMER).start()
        z.all_gather_dp_groups(
            groups_flat=self.bit16_groups_flat,
            partitioned_param_groups=self.parallel_partitioned_bit16_groups,
            dp_process_group=self.real_dp_process_group,
            start_alignment_factor=self.nccl_start_alignment_factor,
            allgather_bucket_size=self.allgather_bucket_size,
        )
        self.timers(z.OPTIMIZER_ALLGATHER_TIMER).stop()
        for i in range(len(self.bit16_groups)):
            self._update_model_bit16_weights(i)

    zero_opt.step = step


def install_tiled_unfused_step(fp16_opt, tiled) -> None:
    """Replace ``FP16_UnfusedOptimizer.step`` (stage 0 with fp16 or bf16) by the tiled step.

    Mirrors ``fp16/unfused_optimizer.py:step`` (0.19.8, l.197-241): overflow check and
    norm on the 16-bit grads first, then, per parameter and tile, up-cast the 16-bit grad
    (a missing grad is zeros, as there), multiply by ``1 / combined_scale`` from
    ``unscale_and_clip_grads(norm, apply_scale=False)``, update, copy back to 16 bits.
    """
    import torch

    u = sys.modules["deepspeed.runtime.fp16.unfused_optimizer"]
    self = fp16_opt
    if self.fused_lamb_legacy:
        _refuse("the legacy fused LAMB path")

    @torch.no_grad()
    def step(closure=None):
        if closure is not None:
            raise ValueError("ds_ext.tiled_optimizer: step(closure) is not supported")
        self.overflow = self.overflow_checker.check()
        if self.overflow:
            return self._skip_invalid_grad_norm()
        norm_groups = []
        for group in self.fp16_groups:
            grads_for_norm, _ = u.split_params_grads_into_shared_and_expert_params(group)
            norm_groups.append(u.get_weight_norm(grads_for_norm, mpu=self.mpu) if grads_for_norm else 0.0)
        self._global_grad_norm = u.get_global_norm(norm_list=norm_groups)
        if u.is_invalid_grad_norm(self._global_grad_norm):
            return self._skip_invalid_grad_norm()
        self._update_scale(False)
        inv_scale = 1.0 / self.unscale_and_clip_grads(self._global_grad_norm, apply_scale=False)
        group_of = {id(p): g for g in self.optimizer.param_groups for p in g["params"]}
        for fp32_group, fp16_group in zip(self.fp32_groups, self.fp16_groups):
            for fp32_param, fp16_param in zip(fp32_group, fp16_group):
                g16 = fp16_param.grad
                pieces = [] if g16 is None else [g16]
                load = _scaled_loader(pieces, fp32_param.numel(), inv_scale)
                flat32, flat16 = fp32_param.data.view(-1), fp16_param.data.view(-1)

                def store(s: int, e: int, flat32=flat32, flat16=flat16) -> None:
                    flat16[s:e].copy_(flat32[s:e])

                tiled.update(fp32_param, group_of[id(fp32_param)], load, store)
                fp32_param.grad = None
        tiled.end_step()
        return self.overflow

    fp16_opt.step = step


def _scaled_loader(pieces, total, inv_scale):
    from ds_ext.optim.tiled import piecewise_loader

    return piecewise_loader(pieces, total, lambda buf: buf.mul_(inv_scale))
