"""Runs Megatron-DeepSpeed's ``pretrain_gpt.py`` and writes, per rank, the loss masks its loss
multiplied and the parameters: the Goldfish acceptance run (tests/test_megatron_deepspeed_goldfish.py).

Usage (examples/megatron_deepspeed_goldfish.sh with ``DUMP=DIR``; the client's directory as working
directory)::

    torchrun --nproc_per_node 4 tests/megatron_goldfish_run.py DIR MODE K H pretrain_gpt.py ARGS...

MODE ``goldfish``: the script runs as under ``python -m ds_ext.run`` (``ds_ext.patch_deepspeed()``;
its ds_config's ``"goldfish"`` block masks); ``plain``: plain DeepSpeed, ds_ext never imported;
``hand``: plain DeepSpeed, and the script's ``get_batch`` and ``get_batch_pipe`` return their
``loss_mask`` multiplied by the hand-written rule (tests/goldfish_reference.py, k = K, h = H) over
the whole sequence ``x_0 .. x_L`` as ``tensor_parallel.broadcast_data`` handed it to them, before
the script shards it (``--sequence-parallel``, ``--ds-sequence-parallel-size``): the reference.

The script is run unmodified as ``__main__``. What this file adds, through names the script
looks up when it calls them: ``megatron.training.pretrain`` is wrapped before the script imports
it, and, once the script calls it, the script's ``loss_func`` (the plain path's loss) records each
``loss_mask`` it gets (and in ``hand`` mode its batch functions are wrapped as above, its
``tensor_parallel`` keeps what ``broadcast_data`` returns);
``deepspeed.initialize`` is wrapped to keep the engine and its initial parameters, and on the
PipelineEngine the module's ``loss_fn`` records the last stage's ``loss_mask``. Written to
``DIR/rank<r>.pt``: the tensor, pipeline, data and (DeepSpeed-Ulysses) sequence ranks, whether
Megatron's ``sequence_parallel`` is on, the ``masks`` in the order the loss used them, and the
``init`` and ``final`` parameters (``engine.module.named_parameters()``).
"""

from __future__ import annotations

import functools
import runpy
import sys
from pathlib import Path

import torch


def _keep(full: torch.Tensor, k: int, h: int) -> torch.Tensor:
    """The hand-written rule on each row of ``full`` ``[b, L + 1]``, for the labels ``x_1 .. x_L``."""
    from goldfish_reference import reference_keep

    return torch.tensor([reference_keep(row, k, h)[1:] for row in full.tolist()])


class _WholeSequence:
    """The script's ``tensor_parallel`` (``hand`` mode): the same module, but it keeps the whole
    sequence ``x_0 .. x_L`` that ``broadcast_data`` hands the batch functions, before they shard it
    (``--sequence-parallel``: the tokens per tensor rank; ``--ds-sequence-parallel-size``: tokens
    and labels per sequence rank)."""

    def __init__(self, module):
        self._module = module
        self.text: torch.Tensor | None = None

    def __getattr__(self, name):
        return getattr(self._module, name)

    def broadcast_data(self, keys, data, datatype):
        data_b = self._module.broadcast_data(keys, data, datatype)
        self.text = data_b["text"].long()
        return data_b


def _hand_batch(get_batch, whole: _WholeSequence, k: int, h: int):
    @functools.wraps(get_batch)
    def masked(data_iterator):
        tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator)
        keep = _keep(whole.text, k, h)
        return tokens, labels, loss_mask * keep.to(loss_mask.dtype), attention_mask, position_ids

    return masked


def _hand_batch_pipe(get_batch_pipe, whole: _WholeSequence, k: int, h: int):
    @functools.wraps(get_batch_pipe)
    def masked(data):
        (tokens, position_ids, attention_mask), (labels, loss_mask) = get_batch_pipe(data)
        keep = _keep(whole.text, k, h)
        return (tokens, position_ids, attention_mask), (labels, loss_mask * keep.to(loss_mask.dtype))

    return masked


def _recording_loss_func(loss_func, masks: list):
    @functools.wraps(loss_func)
    def recorded(loss_mask, *args, **kwargs):
        masks.append(loss_mask.detach().clone())
        return loss_func(loss_mask, *args, **kwargs)

    return recorded


def _recording_loss_fn(loss_fn, masks: list):
    def recorded(output, labels):
        masks.append(labels[1].detach().clone())
        return loss_fn(output, labels)

    return recorded


def _params(engine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


if __name__ == "__main__":
    out, mode, k, h, script = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    assert mode in ("goldfish", "hand", "plain"), mode
    out.mkdir(parents=True, exist_ok=True)
    sys.argv = sys.argv[5:]
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # goldfish_reference
    sys.path.insert(0, str(Path(script).resolve().parent))
    import deepspeed
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # unused on CPU, a 1-min JIT build otherwise
    if mode == "goldfish":
        import ds_ext

        ds_ext.patch_deepspeed()
    import megatron.training

    masks: list[torch.Tensor] = []
    engines: list = []
    pretrain = megatron.training.pretrain

    @functools.wraps(pretrain)
    def pretrain_recording(train_valid_test_dataset_provider, model_provider, model_type, forward_step_func, **kw):
        script_globals = forward_step_func.__globals__  # the script's module, run as __main__
        script_globals["loss_func"] = _recording_loss_func(script_globals["loss_func"], masks)
        if mode == "hand":
            whole = _WholeSequence(script_globals["tensor_parallel"])
            script_globals["tensor_parallel"] = whole
            script_globals["get_batch"] = _hand_batch(script_globals["get_batch"], whole, k, h)
            script_globals["get_batch_pipe"] = _hand_batch_pipe(script_globals["get_batch_pipe"], whole, k, h)
        return pretrain(train_valid_test_dataset_provider, model_provider, model_type, forward_step_func, **kw)

    megatron.training.pretrain = pretrain_recording
    initialize = deepspeed.initialize

    @functools.wraps(initialize)
    def initialize_and_keep(*args, **kwargs):
        result = initialize(*args, **kwargs)
        engine = result[0]
        engines.append((engine, _params(engine)))
        if isinstance(engine, deepspeed.PipelineEngine):
            engine.module.loss_fn = _recording_loss_fn(engine.module.loss_fn, masks)
        return result

    deepspeed.initialize = initialize_and_keep
    runpy.run_path(script, run_name="__main__")

    from megatron import get_args
    from megatron.core import parallel_state

    args = get_args()
    ((engine, init),) = engines
    torch.save(
        {
            "tensor_rank": parallel_state.get_tensor_model_parallel_rank(),
            "pipeline_rank": parallel_state.get_pipeline_model_parallel_rank(),
            "data_rank": parallel_state.get_data_parallel_rank(),
            "sequence_parallel": args.sequence_parallel,  # Megatron's, over the tensor group
            "sequence_rank": parallel_state.get_sequence_parallel_rank(),  # DeepSpeed-Ulysses'
            "masks": masks,
            "init": init,
            "final": _params(engine),
        },
        out / f"rank{torch.distributed.get_rank()}.pt",
    )
    torch.distributed.destroy_process_group()  # as ds_ext.run does after a clean run (pytorch#190489)
