"""The forked ZeRO-1/2 and unfused fp16 optimizer steps of the tiled optimizer (001 §7.2).

``DeepSpeedZeroOptimizer.step`` and ``FP16_UnfusedOptimizer.step`` are mirrored from each
tested DeepSpeed release with only the per-group update replaced by the tiled one. The
releases differ before the update: 0.19.8 computes the global norm before the loss-scale
update, treats an invalid norm as an overflow and may skip the norm (``compute_grad_norm``);
0.19.6 (the last release Megatron-DeepSpeed imports) updates the loss scale first and then
always computes the norm. The release is recognized by the digest of its ``step`` source
(:func:`ds_version.forked_release`); any other source is refused, since a silently stale
fork would train wrongly. Each release is verified by a test (0.19.8:
tests/test_tiled_optimizer.py; 0.19.6: tests/test_tiled_optimizer_releases.py). Behind the
version gate of :mod:`ds_ext.integration.ds_version`. The tiled update itself comes from the layer
above (``ds_ext.optim.plugin`` passes ``ds_ext.optim.tiled``'s ``TiledAdam``, ``piecewise_loader``
and ``refuse_closure``).
"""

from __future__ import annotations

import sys
from typing import Any, Callable

from ds_ext.errors import DsExtConfigError
from ds_ext.integration.ds_version import check_version, forked_release

check_version()

# sha256 of the ``step`` sources the forked steps mirror, per tested DeepSpeed release.
ZERO12_STEP_SHA256 = {
    "0.19.8": "9520884fd916d178728985781674b3c26241dde23e71043dc0beabe507b63b5c",
    "0.19.6": "db8ff3856f37a5bb2bcae3fe82deefeecd1debd6a2ae77ebd0b72d79d10b7d4d",
}
UNFUSED_STEP_SHA256 = {
    "0.19.8": "626bd9aa8af843e9dbc3d2d98ca05e0f31951af9f63c46bd1104e1afe513e16d",
    "0.19.6": "391f9b64766de806c08d03fd0ad8ac356dfc0cfe23fa2eb1a2eb2ab1012c508c",
}


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


Loader = Callable[..., Callable[[Any, int], None]]  # (pieces, total, scale) -> LoadTile (ds_ext.optim.tiled)


def _refuse(what: str) -> None:
    raise DsExtConfigError(
        f"ds_ext.tiled_optimizer: not supported together with {what}; supported: ZeRO stage 0, 1 or 2 "
        "(fp32, fp16 or bf16) without offload, or ds_ext.zero_topo"
    )


def install_tiled_zero_step(zero_opt, tiled, piecewise_loader: Loader, refuse_closure: Callable[[Any], None]) -> None:
    """Replace ``DeepSpeedZeroOptimizer.step`` by the tiled step (001 §7.2).

    Mirrors ``stage_1_and_2.py:step`` (non-offload branch; 0.19.8 l.3013-3191, 0.19.6
    l.2080-2206) and reuses its overflow check, global norm (incl. MoE expert-norm averaging),
    loss-scale update and ``unscale_and_clip_grads``; only the per-group "flatten,
    ``.to(fp32)``, optimizer step, copy to 16-bit" is replaced by
    :meth:`ds_ext.optim.tiled.TiledAdam.update` reading the partition's 16-bit gradient
    pieces (``averaged_gradients[i]``) tile by tile.
    """
    import torch
    from deepspeed import comm as ds_dist

    z = sys.modules["deepspeed.runtime.zero.stage_1_and_2"]
    release = forked_release(z.DeepSpeedZeroOptimizer.step, ZERO12_STEP_SHA256, "ds_ext.tiled_optimizer")

    if zero_opt.cpu_offload:
        _refuse("zero_optimization.offload_optimizer")
    if zero_opt.zenflow:
        _refuse("zenflow")
    if zero_opt.torch_autocast_gradscaler is not None:
        _refuse("torch_autocast")
    self = zero_opt

    def group_update(i: int, factor) -> None:
        partition_id = ds_dist.get_rank(group=self.real_dp_process_group[i])
        self.free_grad_in_param_list(self.params_not_in_partition[i])
        pre = self._get_preflattened_grad_partition(i)
        pieces = [pre] if pre is not None else list(self.averaged_gradients[i])
        if release != "0.19.6" and self._muon_update_lacks_loss_scale(i):  # Muon's path from 0.19.7 on
            _refuse("Muon")
        fp32 = self.single_partition_of_fp32_groups[i]
        bit16 = self.parallel_partitioned_bit16_groups[i][partition_id]
        load = piecewise_loader(pieces, int(self.partition_size[i]), lambda buf: buf.mul_(factor))

        def store(s: int, e: int) -> None:
            bit16.data[s:e].copy_(fp32.data[s:e])

        tiled.update(fp32, self.optimizer.param_groups[i], load, store)
        self.free_grad_in_param_list(self.params_in_partition[i])
        self._release_preflattened_grad_buffers(i)
        self.averaged_gradients[i] = None
        self.all_grad_tensors[i] = None

    def overflow_and_norm_0_19_8():
        """0.19.8: overflow, then the norm (an invalid one is an overflow), then the loss scale."""
        if not self.compute_grad_norm:
            self._global_grad_norm = None
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
            return None
        if norm is not None:
            self._global_grad_norm = norm / prev_scale
        return norm

    def overflow_and_norm_0_19_6():
        """0.19.6: overflow, then the loss scale, then the norm (always computed)."""
        if self.check_grad_overflow:
            self.check_overflow(partition_gradients=self.partition_gradients)
        prev_scale = self.loss_scale
        self._update_scale(self.overflow)
        if self.overflow:
            return None
        norm = self.scaled_global_norm()
        self._global_grad_norm = norm / prev_scale
        return norm

    overflow_and_norm = overflow_and_norm_0_19_6 if release == "0.19.6" else overflow_and_norm_0_19_8

    @torch.no_grad()
    def step(closure=None):
        refuse_closure(closure)
        self.micro_step_id = z.INITIAL_MICRO_STEP_ID
        # 1. overflow, global norm and loss scale, before any tile is touched
        norm = overflow_and_norm()
        if self.overflow:
            self.zero_grad(set_to_none=True)
            self._release_preflattened_grad_buffers()
            for k in self.averaged_gradients.keys():
                self.averaged_gradients[k] = None
                self.all_grad_tensors[k] = None
            for timer in z.OPTIMIZER_TIMERS:
                self.timers(timer).start()
                self.timers(timer).stop()
            return
        # 2. tiled up-cast, unscale/clip, update, copy back
        self.timers(z.OPTIMIZER_STEP_TIMER).start()
        # DeepSpeed's own unscale / clip, run once per step on a one: its factor 1 / combined_scale,
        # exactly (1.0 times it), which every tile of every group multiplies by as
        # unscale_and_clip_grads would (its scale and clip are the step's, not a group's)
        factor = torch.ones(1, dtype=torch.float32, device=self.single_partition_of_fp32_groups[0].device)
        self.unscale_and_clip_grads([factor], norm)
        for i in range(len(self.bit16_groups)):
            group_update(i, factor)
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


def install_tiled_unfused_step(
    fp16_opt, tiled, piecewise_loader: Loader, refuse_closure: Callable[[Any], None]
) -> None:
    """Replace ``FP16_UnfusedOptimizer.step`` (stage 0 with fp16 or bf16) by the tiled step.

    Mirrors ``fp16/unfused_optimizer.py:step`` (0.19.8 l.197-241, 0.19.6 l.190-239): overflow
    check and norm on the 16-bit grads first (0.19.8: an invalid norm skips the step and the
    loss scale is updated after the norm; 0.19.6: the loss scale is updated right after the
    overflow check), then, per parameter and tile, up-cast the 16-bit grad
    (a missing grad is zeros, as there), multiply by ``1 / combined_scale`` from
    ``unscale_and_clip_grads(norm, apply_scale=False)``, update, copy back to 16 bits.
    """
    import torch

    u = sys.modules["deepspeed.runtime.fp16.unfused_optimizer"]
    release = forked_release(u.FP16_UnfusedOptimizer.step, UNFUSED_STEP_SHA256, "ds_ext.tiled_optimizer")
    self = fp16_opt
    if self.fused_lamb_legacy:
        _refuse("the legacy fused LAMB path")

    @torch.no_grad()
    def step(closure=None):
        refuse_closure(closure)
        self.overflow = self.overflow_checker.check()
        if release == "0.19.6":
            self._update_scale(self.overflow)
            if self.overflow:
                return self.overflow
        elif self.overflow:
            return self._skip_invalid_grad_norm()
        norm_groups = []
        for group in self.fp16_groups:
            grads_for_norm, _ = u.split_params_grads_into_shared_and_expert_params(group)
            norm_groups.append(u.get_weight_norm(grads_for_norm, mpu=self.mpu) if grads_for_norm else 0.0)
        self._global_grad_norm = u.get_global_norm(norm_list=norm_groups)
        if release != "0.19.6":
            if u.is_invalid_grad_norm(self._global_grad_norm):
                return self._skip_invalid_grad_norm()
            self._update_scale(False)
        inv_scale = 1.0 / self.unscale_and_clip_grads(self._global_grad_norm, apply_scale=False)
        group_of = {id(p): g for g in self.optimizer.param_groups for p in g["params"]}
        for fp32_group, fp16_group in zip(self.fp32_groups, self.fp16_groups):
            for fp32_param, fp16_param in zip(fp32_group, fp16_group):
                g16 = fp16_param.grad
                pieces = [] if g16 is None else [g16]
                load = piecewise_loader(pieces, fp32_param.numel(), lambda buf: buf.mul_(inv_scale))
                flat32, flat16 = fp32_param.data.view(-1), fp16_param.data.view(-1)

                def store(s: int, e: int, flat32=flat32, flat16=flat16) -> None:
                    flat16[s:e].copy_(flat32[s:e])

                tiled.update(fp32_param, group_of[id(fp32_param)], load, store)
                fp32_param.grad = None
        tiled.end_step()
        return self.overflow

    fp16_opt.step = step
