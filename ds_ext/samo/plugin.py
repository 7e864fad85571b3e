"""The ``samo`` plugin: SAMO from the ds_config (001 ch. 4).

``"ds_ext": {"samo": {"enabled": true, "mask": "prune"}}`` trains a pruned model with every model
state but the dense 16-bit weights compressed by its pruning mask:

* ``check``: refuses, before any collective, every other ds_ext plugin but the tiled optimizer,
  DeepSpeed-MoE experts and a PipelineModule's tied layers (:mod:`ds_ext.samo.support`);
* ``prepare``: refuses the DeepSpeed settings SAMO does not implement (ZeRO stage 3, ZeRO-2 with
  a PipelineModule, tensor parallelism, optimizers other than Adam / AdamW), reads the mask (:mod:`ds_ext.samo.mask`),
  reads ``bf16`` / ``fp16`` (DeepSpeed's own loss scaler) / ``gradient_clipping`` and hands
  DeepSpeed a copy with those off; casts the model to the training dtype;
* ``attach``: after DeepSpeed has broadcast rank 0's weights, checks that every data-parallel rank
  holds the same mask, builds the shared indices and the compressed gradient buffer with its
  backward hooks (:mod:`ds_ext.samo.state`), swaps the engine's optimizer for
  :class:`~ds_ext.samo.optimizer.SamoOptimizer` (which all-reduces the compressed gradients over
  the data-parallel group and stops DeepSpeed's dense all-reduce; under ZeRO-1 it shards them, under
  ZeRO-2 :mod:`ds_ext.samo.zero2` reduces them in buckets during backward into each rank's shard,
  and under both the engine's save / load_checkpoint are refused on every rank), scales the loss for fp16 (on the
  last stage of a PipelineEngine) and makes the engine report the dtype and clipping it applies;
* ``use_tiles``: asked by ``ds_ext.tiled_optimizer`` after ``attach``, runs the compressed step in its
  tiles (001 §7.2, :mod:`ds_ext.samo.tiled`).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist

from ds_ext.comm import backend_device
from ds_ext.errors import DsExtConfigError
from ds_ext.optim.tiled import TiledAdam
from ds_ext.perf import samo as samo_model
from ds_ext.plugin import Plugin
from ds_ext.samo import support
from ds_ext.samo.config import KEY, SamoConfig
from ds_ext.samo.mask import read_masks
from ds_ext.samo.optimizer import SamoOptimizer
from ds_ext.samo.state import CompressedGradients
from ds_ext.samo.tiled import TiledSamoStep
from ds_ext.samo.zero2 import BucketedGradients, BucketedSamoOptimizer


class SamoPlugin(Plugin):
    """SAMO (001 ch. 4) as a ds_ext plugin (module docstring)."""

    name = "samo"
    Config = SamoConfig
    owns_step = True  # the compressed all-reduce, norm, clipping, loss scaling and step

    grads: CompressedGradients
    optimizer: SamoOptimizer
    tiles: TiledSamoStep | None = None  # beside ds_ext.tiled_optimizer (use_tiles)

    def check(self, model: Any) -> None:
        """Refuse the plugins SAMO runs beside none of and the models it cannot compress."""
        support.check_plugins(self.runtime.plugins)
        support.check_model(model)

    def prepare(self, model: Any, optimizer: Any, ds_config: dict) -> tuple[Any, Any, dict]:
        """Read the pruning masks (001 §4.1), check layout, dtype, ZeRO stage and optimizer, and hand
        DeepSpeed an fp32, stage-0, unclipped config (SAMO owns the step)."""
        from ds_ext.integration import ds_engine  # DeepSpeed is imported on use

        layout = self.runtime.parallel
        support.check_layout(layout.degree("tensor"), layout.source)
        self.dtype = ds_engine.training_dtype(ds_config)
        self.stage = support.check_ds_config(ds_config, self.dtype)
        support.check_pipeline_stage(model, self.stage)
        self.bucket_size = ds_engine.zero_config(ds_config).reduce_bucket_size
        support.check_optimizer(optimizer, ds_config)
        self.masks = read_masks(model, self.config.mask, self.config.mask_file)
        if not self.masks and ds_engine.pipeline_grid(model) is None:
            raise DsExtConfigError(
                f"{KEY}.mask {self.config.mask!r} found no pruning mask in the model; allowed: a model pruned with "
                "torch.nn.utils.prune ('prune'), weights with zeros ('zeros'), or a mask_file ('file')"
            )
        self.scaler = ds_engine.loss_scaler(ds_config)
        self.clip = ds_engine.gradient_clipping(ds_config)
        cfg = copy.deepcopy(ds_config)
        for key in ("bf16", "fp16"):
            cfg.setdefault(key, {})["enabled"] = False
        cfg["gradient_clipping"] = 0.0
        cfg.setdefault("zero_optimization", {})["stage"] = 0  # stages 1 and 2: SAMO shards (SamoOptimizer)
        (cfg.get("data_types") or {}).pop("grad_accum_dtype", None)
        return model.to(self.dtype), optimizer, cfg

    def attach(self, engine: Any) -> None:
        """Compress gradients and optimizer state by the masks and put SAMO's compressed step (001 §4.1.3) in
        place of DeepSpeed's optimizer."""
        from ds_ext.integration import ds_engine  # DeepSpeed is imported on use

        rt = self.runtime
        ds_engine.torch_optimizer(engine, KEY, f"a torch.optim.Optimizer ({support.ALLOWED_OPTIMIZERS})")
        params = [p for p in engine.module.parameters() if p.requires_grad]
        layout = rt.parallel
        data_group = rt.groups.group(layout.partition("data")) if layout.degree("data") > 1 else None
        model_group = rt.groups.group(layout.partition("model")) if layout.degree("model") > 1 else None
        shard = self.stage >= 1 and data_group is not None
        self.accumulation = engine.gradient_accumulation_steps()
        if shard and self.stage == 2:
            self.grads = BucketedGradients(params, self.masks, self.dtype, rt.comm, data_group, self.bucket_size)
        else:
            self.grads = CompressedGradients(params, self.masks, self.dtype, layout.degree("data") if shard else 1)
        del self.masks  # the indices hold them now
        self._check_masks_agree(data_group)
        kind = BucketedSamoOptimizer if isinstance(self.grads, BucketedGradients) else SamoOptimizer
        self.optimizer = kind(
            self.grads, engine.optimizer, rt.comm, self.clip, self.scaler, data_group, model_group, shard
        )
        ds_engine.replace_optimizer(engine, self.optimizer)
        if shard:  # refused on every rank, before DeepSpeed saves on data-parallel rank 0 alone

            def refuse(original: Any, **arguments: Any) -> None:
                self.optimizer.check_checkpointable()

            ds_engine.wrap_checkpoint_methods(engine, save_checkpoint=refuse, load_checkpoint=refuse)
        if self.dtype == torch.float16 and ds_engine.is_pipeline_engine(engine):
            ds_engine.scale_pipeline_loss(engine, lambda: self.scaler.loss_scale)
        elif self.dtype == torch.float16:
            ds_engine.scale_backward_loss(engine, lambda: self.scaler.loss_scale)
        ds_engine.report_precision(engine, self.dtype)
        ds_engine.report_gradient_clipping(engine, self.clip)

    def _check_masks_agree(self, data_group: object | None) -> None:
        """Every data-parallel rank must hold the same indices (a mask drawn per rank would train
        different models): their count and a position-weighted checksum are compared by MAX and
        MIN over the group, one line on every rank if they differ."""
        if data_group is None:
            return
        checksum = sum(
            float((i + 1) * e.index.double().sum()) for i, e in enumerate(self.grads.entries) if e.index is not None
        )
        device = backend_device(data_group)
        sig = torch.tensor([float(self.grads.kept), checksum], dtype=torch.float64, device=device)
        hi, lo = sig.clone(), -sig
        self.runtime.comm.all_reduce(hi, op=dist.ReduceOp.MAX, group=data_group)
        self.runtime.comm.all_reduce(lo, op=dist.ReduceOp.MAX, group=data_group)
        if not torch.equal(hi, -lo):
            raise DsExtConfigError(
                f"{KEY}: the data-parallel ranks hold different pruning masks (kept entries from {int(-lo[0])} to "
                f"{int(hi[0])}); allowed: the same mask on every rank (seed the pruning, or use mask 'file')"
            )

    def use_tiles(self, tile_size: int) -> TiledAdam:
        """The compressed step in tiles of ``tile_size`` (``ds_ext.tiled_optimizer``, 001 §7.2)."""
        self.tiles = TiledSamoStep(self.optimizer, tile_size)
        self.optimizer.tiled = self.tiles
        return self.tiles.adam

    def describe(self) -> str:
        """The start-up banner's line (after ``attach``): the mask's source and the kept fraction."""
        g = self.grads
        return (
            f"mask from {self.config.mask!r}, {g.kept:,} of {g.phi:,} entries kept "
            f"(p = {1 - g.kept / max(g.phi, 1):.3f}); model states compressed, the kept gradients all-reduced"
        )

    # ---- the analytic model beside what this run holds and sends (ds_ext.perf.samo) ----------
    def state_bytes(self) -> dict[str, int]:
        """Bytes per model state SAMO held at the largest step peak so far (measured)."""
        return self.optimizer.state_bytes()

    def analytic_state_bytes(self) -> int:
        """Eq. 4.1 for this run's parameters, kept entries and dtype (under ZeRO-1 / 2, this rank's share;
        with the tiled optimizer, its tiles')."""
        g, o, w = self.grads, self.optimizer, self.dtype.itemsize
        tiles = self.tiles
        tile = tiles.adam.tile_size if tiles is not None else None
        if o.sharded:
            if isinstance(g, BucketedGradients):
                untiled = samo_model.zero2_model_state_bytes(
                    g.phi, g.kept, g.indexed, w, o.data_size, o.rank, self.bucket_size
                )
            else:
                untiled = samo_model.sharded_model_state_bytes(g.phi, g.kept, g.indexed, w, o.data_size, o.rank)
            return untiled if tile is None else samo_model.tiled_shard_bytes(untiled, g.kept, w, o.data_size, tile)
        if tile is not None:
            return samo_model.tiled_model_state_bytes(g.phi, g.kept, g.indexed, w, tile, tiles.largest_tile)
        return samo_model.model_state_bytes(g.phi, g.kept, g.indexed, w)

    def analytic_allreduce_bytes(self) -> tuple[float, float]:
        """(SAMO's, dense training's) gradient all-reduce bytes per step on this rank (§4.2.1; under
        ZeRO-1 the reduce-scatter and all-gather of the padded buffer, the same sum; under ZeRO-2 a
        reduce-scatter per micro-batch and one all-gather, ``perf.samo.zero2_reduction_bytes``)."""
        d, w, g = self.optimizer.data_size, self.dtype.itemsize, self.grads
        padded = g.shard_size * d if self.optimizer.sharded else g.kept
        if isinstance(g, BucketedGradients):
            ga = self.accumulation
            return samo_model.zero2_reduction_bytes(padded, w, d, ga), samo_model.zero2_reduction_bytes(g.phi, w, d, ga)
        return samo_model.allreduce_bytes(padded, w, d), samo_model.allreduce_bytes(g.phi, w, d)
