"""``"ds_ext": {"tiled_optimizer": {"enabled": true, "tile_size": 1800000}}`` (001 §7.2).

Runs the optimizer step in tiles of ``tile_size`` parameters through one reused fp32
buffer (:mod:`ds_ext.optim.tiled`), wherever the step happens, with no change to the
user's param groups (no ``split_params_into_different_moe_groups_for_optimizer(...,
max_group_size=...)``):

* DeepSpeed ZeRO stage 1/2 (``DeepSpeedZeroOptimizer``, fp32 / fp16 / bf16, DeepSpeed-MoE
  expert groups included): its ``step`` is replaced by the tiled one
  (``ds_ext.integration.ds_zero12_step.install_tiled_zero_step``);
* stage 0 with fp16 or bf16 (DeepSpeed 0.19.8 wraps a torch optimizer in
  ``FP16_UnfusedOptimizer`` for both): ``ds_ext.integration.ds_zero12_step.install_tiled_unfused_step``;
* stage 0 in fp32: the torch optimizer's ``step`` runs tiled;
* ZeRO-topo (``"zero_topo": {"enabled": true}``): its sharded step updates tile by tile and
  overlaps each unit's weight all-gather with the next unit's update; with
  ``zero_optimization.offload_optimizer`` that step runs on the host in these tiles (001 §3.3.2,
  :mod:`ds_ext.optim.offload`).
* SAMO (``"samo": {"enabled": true}``, 001 ch. 4): its compressed step updates each compressed
  master tile by tile and expands each tile's 16-bit copy into the dense weights
  (:mod:`ds_ext.samo.tiled`).

Memory (measured by tests/test_tiled_optimizer.py and ``ds-ext bench tiled``): during the
step the tiled path holds the tile buffer, 4 x tile_size bytes (allocated at the step's
first tile, freed at its end), plus a constant that does not grow with the number of
experts: the global-norm pass, kept exactly as the untiled step does it so that the clip
coefficient is bit-identical, up-casts one gradient tensor at a time (DeepSpeed: to fp64,
``zero/utils.py:get_norm_dtype``, so 8 bytes x the largest parameter; ZeRO-topo: at most 16
bytes x the largest parameter segment), and about 1 MiB of allocator, gloo and Python slack.
The step peak is therefore max(4 x tile_size, 8 x largest parameter) + ~1 MiB on DeepSpeed.

The optimizer must be a torch ``Adam`` / ``AdamW`` or DeepSpeed's ``FusedAdam`` (an instance
passed as ``optimizer=``, or a ds_config ``"optimizer"`` of type Adam/AdamW: FusedAdam, or
torch's with ``"torch_adam": true``); anything else, and FusedAdam at stage 0 in fp16/bf16
(DeepSpeed's fused FP16_Optimizer), fails before DeepSpeed builds the engine, naming
``ds_ext.tiled_optimizer`` and what is allowed.
"""

from __future__ import annotations

from typing import Any

import torch

from ds_ext.errors import DsExtConfigError
from ds_ext.integration import ds_fused_adam
from ds_ext.optim.config import DEFAULT_TILE_SIZE, TiledOptimizerConfig
from ds_ext.optim.tiled import (
    ALLOWED_TYPES,
    FUSED_TILE_MULTIPLE,
    KEY,
    TiledAdam,
    check_tileable,
    piecewise_loader,
    refuse_closure,
)
from ds_ext.plugin import Plugin


def _check_ds_config(
    ds_config: dict, optimizer: Any, tile_size: int = DEFAULT_TILE_SIZE, owner_steps: bool = False
) -> None:
    """Everything the tiled step cannot serve is refused here, before DeepSpeed builds the engine.
    ``owner_steps``: a plugin replaces DeepSpeed's step (ZeRO-topo), so DeepSpeed wraps no optimizer
    in its fp16 / bf16 optimizers and their limits do not apply."""
    zero = ds_config.get("zero_optimization", {}) or {}
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2):
        raise DsExtConfigError(
            f"{KEY}: zero_optimization.stage {stage} is not tiled; allowed: 0, 1, 2 (or ds_ext.zero_topo)"
        )
    if not owner_steps:  # ZeRO-topo reads (and offloads) its own; DeepSpeed's ZeRO would run its CPU Adam
        from ds_ext.integration import ds_offload  # DeepSpeed is imported on use

        offload = ds_offload.read(zero)
        for key, section in (("offload_optimizer", offload.optimizer), ("offload_param", offload.param)):
            if section["device"] != "none":
                raise DsExtConfigError(
                    f"{KEY}: zero_optimization.{key}.device {section['device']!r} on DeepSpeed's ZeRO stage {stage} "
                    "is not tiled (DeepSpeed's own CPU step); allowed: 'none', or optimizer offload with "
                    "ds_ext.zero_topo (its host step is tiled)"
                )
    if zero.get("zenflow"):
        raise DsExtConfigError(f"{KEY}: zero_optimization.zenflow is not tiled; allowed: no zenflow section")
    if (ds_config.get("torch_autocast") or {}).get("enabled"):
        raise DsExtConfigError(
            f"{KEY}: torch_autocast.enabled is not tiled; allowed: false (use the bf16/fp16 sections)"
        )
    if optimizer is None:
        section = ds_config.get("optimizer")
        if section is None:
            raise DsExtConfigError(f"{KEY}: no optimizer; pass a torch optimizer ({ALLOWED_TYPES})")
        kind = str(section.get("type", "")).lower()
        params = section.get("params") or {}
        if kind not in ("adam", "adamw"):
            raise DsExtConfigError(
                f"{KEY}: ds_config optimizer {section.get('type')!r} is not tiled; allowed types: {ALLOWED_TYPES} "
                "(ds_config 'Adam'/'AdamW': FusedAdam, or torch's with \"torch_adam\": true)"
            )
        ds_fused = not params.get("torch_adam", False)  # DeepSpeed builds its FusedAdam (no offload here)
        if (params.get("fused") or ds_fused) and tile_size % FUSED_TILE_MULTIPLE:
            raise DsExtConfigError(
                f"{KEY}.tile_size: a fused optimizer (FusedAdam or fused=True) needs tiles of whole 64-byte cache "
                f"lines; allowed: a multiple of {FUSED_TILE_MULTIPLE} (got {tile_size})"
            )
    elif isinstance(optimizer, torch.optim.Optimizer):
        check_tileable(optimizer, tile_size)
        ds_fused = ds_fused_adam.is_fused_adam(optimizer)
    else:
        ds_fused = False
    low_precision = any((ds_config.get(k) or {}).get("enabled") for k in ("fp16", "bf16"))
    if ds_fused and stage == 0 and low_precision and not owner_steps:
        raise DsExtConfigError(
            f"{KEY}: DeepSpeed wraps FusedAdam in its fused FP16_Optimizer at zero_optimization.stage 0 with "
            "fp16/bf16, which is not tiled; allowed: stage 1 or 2, fp32, or torch AdamW"
        )


class TiledOptimizerPlugin(Plugin):
    """The tiled mixed-precision optimizer step (001 §7.2) as a ds_ext plugin."""

    name = "tiled_optimizer"
    Config = TiledOptimizerConfig

    tiled: TiledAdam

    def prepare(self, model: Any, optimizer: Any, ds_config: dict) -> tuple[Any, Any, dict]:
        """Check the ds_config and the optimizer against the tiled step (001 §7.2)."""
        _check_ds_config(ds_config, optimizer, self.config.tile_size, self.runtime.step_owner() is not None)
        return model, optimizer, ds_config

    def attach(self, engine: Any) -> None:
        """Run the optimizer step in tiles: the step owner's through :meth:`~ds_ext.plugin.Plugin.use_tiles`,
        else DeepSpeed's ZeRO-1/2, unfused fp16 or plain step replaced by the tiled one."""
        from ds_ext.integration import ds_zero12_step  # DeepSpeed is imported on use

        ts = self.config.tile_size
        owner = self.runtime.step_owner()
        if owner is not None:  # a plugin's own step (ZeRO-topo's: on the host with optimizer offload)
            tiled = owner.use_tiles(ts)
            if tiled is None:
                raise DsExtConfigError(
                    f"{KEY} with ds_ext.{owner.name}: its optimizer step does not run tiled; allowed: one of the two"
                )
            self.tiled = tiled
            return
        opt = engine.optimizer
        kind = ds_zero12_step.optimizer_kind(opt)
        if kind == "zero12":
            self.tiled = TiledAdam(opt.optimizer, ts)
            ds_zero12_step.install_tiled_zero_step(opt, self.tiled, piecewise_loader, refuse_closure)
        elif kind == "unfused16":
            self.tiled = TiledAdam(opt.optimizer, ts)
            ds_zero12_step.install_tiled_unfused_step(opt, self.tiled, piecewise_loader, refuse_closure)
        elif kind == "plain":
            self.tiled = TiledAdam(opt, ts)
            opt.step = _plain_step(self.tiled)
        else:
            raise DsExtConfigError(
                f"{KEY}: DeepSpeed built a {kind} around the optimizer, which is not tiled; supported: "
                "ZeRO stage 0/1/2 without offload (DeepSpeedZeroOptimizer, FP16_UnfusedOptimizer, "
                "a plain torch optimizer) or ds_ext.zero_topo"
            )


def _plain_step(tiled: TiledAdam):
    def step(closure=None):
        refuse_closure(closure)
        tiled.step_fp32_params()

    return step
