"""ZeRO-topo under GPT-NeoX's own setup path (issue 18, defect 1 and acceptance).

The real GPT-NeoX (../shared/clients/gpt-neox, unmodified) builds everything: ``NeoXArgs``
from its shipped ``configs/19M.yml`` (shrunk, ``pipe_parallel_size: 0`` for the plain
model, a ``ds_ext`` block in ``deepspeed_extra_args``), its mpu, its model (``get_model``), its optimizer
(``get_optimizer``: DeepSpeed's FusedAdam, since apex is absent) and its LR scheduler, and
``deepspeed.initialize`` is called as ``setup_model_and_optimizer`` calls it
(megatron/training.py:1188): its optimizer object AND a ds_config with its ``optimizer``
section, ``args`` whose ``deepspeed_config`` is a dict, ``dist_init_required=False`` and
its mpu (the lines after that call count parameters on a CUDA device). The training
step is GPT-NeoX's: its masks, its model, its ``cross_entropy``, ``model.backward``,
``model.step``. 4 gloo ranks, fp32, 10 steps.

Only the steps its ``initialize_megatron`` runs solely where CUDA devices exist are done
here by calling GPT-NeoX's own functions (mpu groups, DeepSpeed's checkpointing set-up),
and its attention, which allocates its score buffer on ``torch.cuda.current_device()``,
gets the CPU for that device on this CPU-only host (the rank process's torch, not the
client's code, is shimmed).
"""

import sys

import pytest

from clients import client_dir, skip_reason

WORLD_SIZE = 4
NEOX = client_dir("gpt-neox")
pytestmark = pytest.mark.skipif(NEOX is None, reason=skip_reason("gpt-neox"))
UNQUANTIZED = {"weights": {"gather_bits": 16}, "gradients": {"bits": 16, "hops": 1}, "secondary": {"bits": 16}}


def _neox_args(zero_topo):
    from megatron.neox_arguments import NeoXArgs

    import torch.distributed as dist

    block = {"topology": {"preset": "frontier", "sizes": {"gpu": 1}, "emulate": True}}
    if zero_topo is not None:
        block["zero_topo"] = {"enabled": True, **zero_topo}
    args = NeoXArgs.from_ymls([str(NEOX / "configs" / "19M.yml")], overwrite_values=dict(
        pipe_parallel_size=0, global_num_gpus=dist.get_world_size(), use_cpu_initialization=True,
        num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, max_position_embeddings=32,
        tokenizer_type="CharLevelTokenizer", fp16={"enabled": False}, precision="fp32",
        zero_optimization={"stage": 0}, checkpoint_activations=False, partition_activations=False,
        gradient_clipping=0.0, train_micro_batch_size_per_gpu=2, distributed_backend="gloo",
        deepspeed_extra_args={"ds_ext": block}, train_iters=10, lr_decay_iters=10, wall_clock_breakdown=False,
        log_interval=1000, steps_per_print=1000, user_script="train.py",
    ))
    args.build_tokenizer()
    return args


def _neox_train(zero_topo, steps=10):
    if str(NEOX) not in sys.path:
        sys.path.insert(0, str(NEOX))
    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
    from megatron import mpu
    from megatron.initialize import _set_random_seed, setup_deepspeed_random_and_activation_checkpointing
    from megatron.model.gpt2_model import cross_entropy
    from megatron.training import get_learning_rate_scheduler, get_model, get_optimizer
    from megatron.utils import get_ltor_masks_and_position_ids

    import ds_ext
    from ds_ext.data import ByteCorpus
    from ds_ext.integration.ds_engine import disable_jit_builds

    torch.cuda.current_device = lambda: "cpu"  # see the module docstring
    args = _neox_args(zero_topo)
    disable_jit_builds()
    deepspeed.init_distributed(dist_backend=args.distributed_backend, auto_mpi_discovery=False)
    world = dist.get_world_size()
    mpu.initialize_model_parallel(1, topology=PipeModelDataParallelTopology(num_pp=1, num_mp=1, num_dp=world),
                                  fp32_allreduce=args.fp32_allreduce)
    setup_deepspeed_random_and_activation_checkpointing(neox_args=args)
    _set_random_seed(args.seed)
    mpu.model_parallel_cuda_manual_seed(args.seed)  # _set_random_seed does this where CUDA devices exist
    neox_model = get_model(neox_args=args)
    optimizer, param_groups = get_optimizer(model=neox_model, neox_args=args)
    lr_scheduler = get_learning_rate_scheduler(optimizer=optimizer, neox_args=args)
    ds_ext.patch_deepspeed()
    try:  # megatron/training.py:1188, verbatim
        model, optimizer, _, lr_scheduler = deepspeed.initialize(
            model=neox_model, optimizer=optimizer, args=args, lr_scheduler=lr_scheduler, dist_init_required=False,
            model_parameters=param_groups if optimizer is None else None,
            mpu=mpu if not args.is_pipe_parallel else None,
        )
    finally:
        ds_ext.unpatch_deepspeed()
    corpus = ByteCorpus(max_bytes=200_000)
    losses = []
    for step in range(steps):
        x = corpus.micro_batch(step, 0, dist.get_rank(), world, 2, 1, args.seq_length)
        tokens, labels = x[:, :-1].contiguous(), x[:, 1:].contiguous()
        attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(tokens, args.tokenizer.eod)
        loss = cross_entropy(model((tokens, position_ids, attention_mask)), (labels, loss_mask))
        model.backward(loss)
        model.step()
        losses.append(loss.item())
    info = {
        "config": type(args.deepspeed_config).__name__, "section": args.deepspeed_config.get("optimizer", {}).get("type"),
        "optimizer": type(optimizer).__name__, "plugins": [p.name for p in model.ds_ext.plugins],
        "inner": type(model.optimizer.inner).__name__ if zero_topo else None,
    }
    model.destroy()
    mpu.destroy_model_parallel()
    return losses, info


def test_neox_trains_zero_topo_with_its_own_optimizer_and_config_section(world):
    """GPT-NeoX's optimizer object and its ds_config ``optimizer`` section together: the
    client optimizer is used (as DeepSpeed does), and 10 steps equal plain data
    parallelism (DeepSpeed stage 0 through the same GPT-NeoX code) to 1e-6 in fp32."""
    plain = world.run(_neox_train, None)
    ours = world.run(_neox_train, {"preset": "zero_topo", **UNQUANTIZED})
    for (a, info), (b, _) in zip(ours, plain):
        assert info["config"] == "dict" and info["section"] == "Adam"  # GPT-NeoX always writes the section
        assert info["plugins"] == ["zero_topo"] and info["inner"] == "FusedAdam"
        assert a == pytest.approx(b, rel=1e-6, abs=0)
    assert plain[0][0][-1] < plain[0][0][0] - 0.5
