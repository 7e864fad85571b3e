"""DeepSpeed-MoE touch points of TED (read in DeepSpeed 0.19.8).

DeepSpeed treats a module as MoE only if it is an instance of ``deepspeed.moe.layer.MoE``
(engine.py:2102 ``has_moe_layers``; ZeRO-1/2 then reduce expert gradients over the expert
data-parallel group of ``param.group_name``, stage_1_and_2.py:880, 1641), and looks that
group up in ``deepspeed.utils.groups._EXPERT_{,DATA_}PARALLEL_GROUP[_RANKS]`` (filled by
``MoE.set_deepspeed_parallelism``, which the engine calls on every module that has it).
TED registers its own groups there under DeepSpeed's name ``ep_size_<G_expert>``.

Behind the version gate of :mod:`ds_ext.integration.ds_version`.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from types import CodeType
from typing import Iterable, Iterator

import torch

from ds_ext.integration.ds_version import check_version

check_version()

from deepspeed.moe.layer import MoE as MoEBase  # noqa: E402  (after the version gate)

__all__ = [
    "MoEBase",
    "expert_group_name",
    "mark_expert_params",
    "register_expert_groups",
    "release_groups",
    "checkpoint_function_codes",
    "is_megatron_checkpoint",
    "flat_gather_tokens",
]


def expert_group_name(ep_size: int) -> str:
    """DeepSpeed's name of the expert groups of ``ep_size`` (moe/layer.py:62)."""
    return f"ep_size_{ep_size}"


def mark_expert_params(params: Iterable[torch.nn.Parameter], group_name: str) -> None:
    """Tag expert parameters the way DeepSpeed's ``Experts`` does (moe/experts.py:24): not
    all-reduced over the data group but over the expert data group of ``group_name``."""
    for p in params:
        p.allreduce = False
        p.group_name = group_name


def register_expert_groups(
    group_name: str,
    expert_group: object,
    expert_ranks: tuple[int, ...],
    expert_data_group: object,
    expert_data_ranks: tuple[int, ...],
    tensor_size: int,
) -> None:
    """Make DeepSpeed's group getters return TED's groups for ``group_name``.

    Replaces any groups registered earlier under the name (one process may build several
    engines), and sets the expert tensor-parallel size DeepSpeed's MoE code reads.
    """
    groups = sys.modules["deepspeed.utils.groups"]
    groups._EXPERT_PARALLEL_GROUP[group_name] = expert_group
    groups._EXPERT_PARALLEL_GROUP_RANKS[group_name] = list(expert_ranks)
    groups._EXPERT_DATA_PARALLEL_GROUP[group_name] = expert_data_group
    groups._EXPERT_DATA_PARALLEL_GROUP_RANKS[group_name] = list(expert_data_ranks)
    groups.expert_tensor_parallel_world_size = tensor_size


def release_groups(group_names: Iterable[str], expert_group: object) -> None:
    """Forget the expert groups ``group_names`` if they still name ``expert_group``. DeepSpeed
    keeps them process-wide and never resets them: a later engine, TED or DeepSpeed's own MoE,
    must not find a finished engine's groups, and a finished engine must not remove a later one's
    (the global ``groups.mpu`` is released for every engine: ``ds_engine.release_mpu_on_destroy``)."""
    groups = sys.modules["deepspeed.utils.groups"]
    for name in group_names:
        if groups._EXPERT_PARALLEL_GROUP.get(name) is not expert_group:
            continue
        for registry in (
            groups._EXPERT_PARALLEL_GROUP,
            groups._EXPERT_PARALLEL_GROUP_RANKS,
            groups._EXPERT_DATA_PARALLEL_GROUP,
            groups._EXPERT_DATA_PARALLEL_GROUP_RANKS,
        ):
            registry.pop(name, None)
        groups.expert_tensor_parallel_world_size = 1


MEGATRON_CHECKPOINT = ("CheckpointFunction.forward", "megatron/core/tensor_parallel/random.py")


def is_megatron_checkpoint(code: CodeType) -> bool:
    """Whether ``code`` is the forward of Megatron's ``CheckpointFunction`` (Megatron-DeepSpeed's
    ``megatron/core/tensor_parallel/random.py`` and megatron-core's module of the same path),
    the recompute ``--checkpoint-activations`` / ``--recompute-granularity full`` run through.
    Recognised by qualified name and file, so neither Megatron has to be importable here."""
    qualname, path = MEGATRON_CHECKPOINT
    return code.co_qualname == qualname and code.co_filename.replace("\\", "/").endswith(path)


def checkpoint_function_codes() -> frozenset[CodeType]:
    """Code objects of the activation-checkpoint entry points whose first forward TED layers
    record for the recompute: ``torch.utils.checkpoint.checkpoint`` (reentrant and not),
    ``deepspeed.checkpointing.checkpoint`` and its ``CheckpointFunction.forward``."""
    import torch.utils.checkpoint as torch_ckpt
    from deepspeed.runtime.activation_checkpointing import checkpointing as ds_ckpt

    fns = (
        torch_ckpt.checkpoint,
        torch_ckpt.CheckpointFunction.forward,
        ds_ckpt.checkpoint,
        ds_ckpt.CheckpointFunction.forward,
    )
    return frozenset(inspect.unwrap(f).__code__ for f in fns)


@contextlib.contextmanager
def flat_gather_tokens() -> Iterator[None]:
    """Let DeepSpeed-MoE's expert tensor parallelism run on gloo (benchmarks only).

    DeepSpeed's ``moe/mappings.py:_gather_tokens`` (0.19.8 l.30-52), the all-gather after the
    all-to-all of its duplicate token dropping, hands ``all_gather_into_tensor`` an N-d input
    and a flat output; NCCL accepts that, gloo rejects it ("invalid tensor size at index 0").
    Inside this context it gets the same input flattened (``view(-1)``, same bytes, same
    result); everything else of DeepSpeed's MoE is unchanged. Restored on exit.
    """
    import deepspeed
    from deepspeed.moe import mappings
    from deepspeed.utils.bwc import bwc_tensor_model_parallel_group, bwc_tensor_model_parallel_world_size

    original = mappings._gather_tokens

    def gather_tokens(input_: torch.Tensor, dim: int = 0) -> torch.Tensor:
        mpu = deepspeed.utils.groups.mpu
        input_ = input_.contiguous()
        world_size = bwc_tensor_model_parallel_world_size(mpu)
        if world_size == 1:
            return input_
        buffer = torch.empty(world_size * input_.numel(), dtype=input_.dtype, device=input_.device)
        deepspeed.comm.all_gather_into_tensor(buffer, input_.view(-1), group=bwc_tensor_model_parallel_group(mpu))
        if dim == 0:
            return buffer.view(world_size * input_.shape[0], *input_.shape[1:])
        chunks = [buffer.narrow(0, input_.numel() * i, input_.numel()).view_as(input_) for i in range(world_size)]
        return torch.cat(chunks, dim=dim).contiguous()

    mappings._gather_tokens = gather_tokens
    try:
        yield
    finally:
        mappings._gather_tokens = original
