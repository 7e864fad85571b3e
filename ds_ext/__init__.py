"""ds_ext: topology-aware extensions for DeepSpeed (ZeRO-topo, TED MoE, tiled optimizer, 3D-PMM).

Entry points: :func:`ds_ext.initialize`, a drop-in for ``deepspeed.initialize`` that reads
the top-level ``"ds_ext"`` block of the ds_config; :func:`ds_ext.patch_deepspeed` (or
``python -m ds_ext.run script.py``) for scripts that call ``deepspeed.initialize``
themselves. Importing ds_ext changes nothing outside it: only activation
(:func:`patch_deepspeed`, ``ds_ext.run``, the autoload directory) wraps ``deepspeed.initialize``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable

from ds_ext.version import __version__

if TYPE_CHECKING:
    import torch

    from ds_ext.entry.initialize import Initialized


def initialize(
    args: Any = None,
    model: "torch.nn.Module | None" = None,
    optimizer: "torch.optim.Optimizer | Callable | None" = None,
    model_parameters: "Iterable[torch.Tensor] | Iterable[dict] | None" = None,
    training_data: "torch.utils.data.Dataset | None" = None,
    lr_scheduler: Any = None,
    distributed_port: int = 29500,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Callable | None = None,
    config: str | dict[str, Any] | None = None,
    mesh_param: Any = None,
    config_params: str | dict[str, Any] | None = None,
) -> Initialized:
    """Set ds_ext up from the ``"ds_ext"`` block of the ds_config, then call ``deepspeed.initialize``.

    Same arguments, in the same order, and the same returned tuple as ``deepspeed.initialize``
    (DeepSpeed 0.19; ``distributed_port`` defaults to DeepSpeed's 29500). Before anything
    distributed happens the block is validated (one-line :class:`ds_ext.config.DsExtConfigError`
    naming the key); then torch.distributed is started without DeepSpeed's JIT builds, the
    topology is detected, the process groups are built, and every enabled plugin wraps the
    model, optimizer and ds_config. Rank 0 prints one banner of what was enabled.

    Args:
        args: an object with ``local_rank`` and ``deepspeed_config``; optional if ``config`` is given.
        model: the ``torch.nn.Module`` to train (required).
        optimizer: a torch optimizer, or a callable returning one; overrides the config's.
        model_parameters: the tensors (or parameter-group dicts) to optimize.
        training_data: a ``torch.utils.data.Dataset`` for DeepSpeed's data loader.
        lr_scheduler: a scheduler, or a callable taking the optimizer and returning one.
        distributed_port: rank 0's port for torch.distributed's rendezvous.
        mpu: a Megatron-style model-parallel unit; a plugin that builds its own refuses a different one.
        dist_init_required: None starts torch.distributed if needed; True / False force it.
        collate_fn: merges samples into a mini-batch for DeepSpeed's data loader.
        config: the ds_config: a dict, a JSON / hjson path or a base64 JSON string.
        mesh_param: DeepSpeed's device-mesh parameters, passed through.
        config_params: same as ``config`` (DeepSpeed's older name).

    Returns:
        ``(engine, optimizer, training_dataloader, lr_scheduler)`` as DeepSpeed returns them, a
        named tuple (:class:`ds_ext.entry.initialize.Initialized`: ``result.engine`` ...);
        ``engine.ds_ext`` is the :class:`ds_ext.runtime.Runtime` (topology, groups, ledger, plugins).
    """
    from ds_ext.entry.initialize import initialize as _initialize

    return _initialize(
        args,
        model,
        optimizer,
        model_parameters,
        training_data,
        lr_scheduler,
        config=config,
        config_params=config_params,
        dist_init_required=dist_init_required,
        distributed_port=distributed_port,
        mpu=mpu,
        collate_fn=collate_fn,
        mesh_param=mesh_param,
    )


def patch_deepspeed() -> None:
    """See :func:`ds_ext.entry.activation.patch_deepspeed`."""
    from ds_ext.entry.activation import patch_deepspeed as _patch

    _patch()


def unpatch_deepspeed() -> None:
    """See :func:`ds_ext.entry.activation.unpatch_deepspeed`."""
    from ds_ext.entry.activation import unpatch_deepspeed as _unpatch

    _unpatch()


__all__ = ["initialize", "patch_deepspeed", "unpatch_deepspeed", "__version__"]
