"""ZeRO-topo under GPT-NeoX's own setup path (and at model parallel 2).

The real GPT-NeoX (../shared/clients/gpt-neox, unmodified) builds everything: ``NeoXArgs``
from its shipped ``configs/19M.yml`` (shrunk, ``pipe_parallel_size: 0`` for the plain
model, a ``ds_ext`` block in ``deepspeed_extra_args``), its mpu, its model (``get_model``), its optimizer
(``get_optimizer``: DeepSpeed's FusedAdam, since apex is absent) and its LR scheduler, and
``deepspeed.initialize`` is called as ``setup_model_and_optimizer`` calls it
(megatron/training.py:1188): its optimizer object AND a ds_config with its ``optimizer``
section, ``args`` whose ``deepspeed_config`` is a dict, ``dist_init_required=False`` and
its mpu (the lines after that call count parameters on a CUDA device). The training
step is GPT-NeoX's: its masks, its model, its ``cross_entropy``, ``model.backward``,
``model.step``. 4 gloo ranks, fp32, 5 steps (of a 10-iteration schedule).

Model parallelism: the same route with ``model_parallel_size: 2``,
``pipe_parallel_size: 0``: the mpu is built with the topology GPT-NeoX's
``_initialize_distributed`` builds (``PipeModelDataParallelTopology(num_pp=1, num_mp=2,
num_dp=2)``: tensor pairs (0, 1), (2, 3), each a GCD pair of the emulated frontier topology, so
the data groups (0, 2), (1, 3) cross only ``node``), and the batch is indexed by the
data-parallel rank, so both tensor ranks see the same micro-batch. The reference is DeepSpeed
ZeRO-1 (``zero_optimization: {"stage": 1}``, no ``zero_topo`` block) through the same code and
GPT-NeoX's FusedAdam; gradient clipping at 0.05 is active on every step. Unquantized ZeRO-topo
equals it to 1e-6: losses, global gradient norms and every parameter of every rank at the end
(gathered inside ``model.ds_ext.gathered_parameters()``), each of which moved from its value right
after ``deepspeed.initialize``. Adam normalises a constant gradient scale away, so the norms are
compared too; with the clipping active a wrong norm also shows in the parameters (a norm that
counts replicated parameters on both tensor ranks differs by 1.5% and moves parameters by up to
5e-5). GPT-NeoX's ``sgd`` optimizer type needs ``mup``, which is not installed here. The default
(quantized) preset moves every parameter and keeps each step's loss within the spread between
ZeRO-1 runs on two data orders (the corpus offset by 1000 steps).

Only the steps its ``initialize_megatron`` runs solely where CUDA devices exist are done
here by calling GPT-NeoX's own functions (mpu groups, DeepSpeed's checkpointing set-up),
and its attention, which allocates its score buffer on ``torch.cuda.current_device()``,
gets the CPU for that device on this CPU-only host (the rank process's torch, not the
client's code, is shimmed; on the pipeline path and in its own ``forward_step`` also
``torch.cuda.LongTensor`` and ``Tensor.cuda``, which its ``mpu.broadcast_data`` calls).

Goldfish: ``"goldfish"`` in the ds_config on the pipeline path (the last stage's
``loss_fn``) and on the plain path (GPT-NeoX's own ``forward_step``, whose ``cross_entropy`` ds_ext
rebinds in ``megatron.training`` while the engine lives) equals the same run whose batch function
multiplies GPT-NeoX's ``loss_mask`` by the hand-written rule (tests/goldfish_reference.py), and
differs from the plain run.
"""

import sys
from functools import partial

import pytest
from clients import client_dir, skip_reason

WORLD_SIZE = 4
# never replaced: a fresh world's ranks re-import the client's Megatron (about 5 s a test, more
# than its groups cost)
WORLD_MAX_GROUPS = None
NEOX = client_dir("gpt-neox")
pytestmark = pytest.mark.skipif(NEOX is None, reason=skip_reason("gpt-neox"))
UNQUANTIZED = {"weights": {"gather_bits": 16}, "gradients": {"bits": 16, "hops": 1}, "secondary": {"bits": 16}}
ACCUM = 2  # micro-batches per train_batch on the pipeline path


def _neox_args(zero_topo, model_parallel=1, stage=0, clip=0.0, pipe=0, extra=None):
    import torch.distributed as dist
    from megatron.neox_arguments import NeoXArgs

    block = {"topology": {"preset": "frontier", "sizes": {"gpu": 1}, "emulate": True}}
    if zero_topo is not None:
        block["zero_topo"] = {"enabled": True, **zero_topo}
    block.update(extra or {})
    args = NeoXArgs.from_ymls(
        [str(NEOX / "configs" / "19M.yml")],
        overwrite_values=dict(
            pipe_parallel_size=pipe,
            model_parallel_size=model_parallel,
            global_num_gpus=dist.get_world_size(),
            gradient_accumulation_steps=ACCUM if pipe else 1,
            use_cpu_initialization=True,
            num_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            seq_length=32,
            max_position_embeddings=32,
            tokenizer_type="CharLevelTokenizer",
            fp16={"enabled": False},
            precision="fp32",
            zero_optimization={"stage": stage},
            checkpoint_activations=False,
            partition_activations=False,
            gradient_clipping=clip,
            train_micro_batch_size_per_gpu=2,
            distributed_backend="gloo",
            deepspeed_extra_args={"ds_ext": block},
            train_iters=10,
            lr_decay_iters=10,
            wall_clock_breakdown=False,
            log_interval=1000,
            steps_per_print=1000,
            user_script="train.py",
        ),
    )
    args.build_tokenizer()
    return args


def _neox_train(
    zero_topo,
    steps=5,
    model_parallel=1,
    stage=0,
    clip=0.0,
    offset=0,
    params=False,
    pipe=0,
    extra=None,
    hand_mask=None,
    its_loop=False,
):
    """GPT-NeoX's setup and ``steps`` training steps (see module); the batch of step s is the
    corpus's step ``s + offset``, indexed by the data-parallel rank (every tensor rank of a
    model-parallel group sees the same micro-batch). With ``params``, also this rank's
    parameters at the end (inside ``gathered_parameters`` with ZeRO-topo), the names of those
    equal to their values right after ``deepspeed.initialize``, and the global gradient norms.
    ``pipe`` >= 1: GPT-NeoX's pipeline path (``GPT2ModelPipe`` on DeepSpeed's PipelineEngine, its
    ``get_batch_pipe``, ``train_step_pipe``'s ``model.train_batch`` over ``ACCUM`` micro-batches).
    ``extra``: more of the ``"ds_ext"`` block; ``hand_mask`` (k, h): the batch function multiplies
    GPT-NeoX's ``loss_mask`` by the hand-written Goldfish rule. ``its_loop``, plain path: each step is
    GPT-NeoX's own ``forward_step`` (its ``get_batch``, model, ``cross_entropy`` as
    ``megatron.training`` names them), then ``model.backward`` and ``model.step`` as its
    ``train_step`` calls them; ``info["masks"]`` holds each ``loss_mask`` its ``cross_entropy`` got."""
    if str(NEOX) not in sys.path:
        sys.path.insert(0, str(NEOX))
    import deepspeed
    import megatron.training as neox_training
    import torch
    import torch.distributed as dist
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
    from megatron import mpu
    from megatron.initialize import _set_random_seed, setup_deepspeed_random_and_activation_checkpointing
    from megatron.model.gpt2_model import cross_entropy
    from megatron.training import get_batch_pipe, get_learning_rate_scheduler, get_model, get_optimizer
    from megatron.utils import get_ltor_masks_and_position_ids

    import ds_ext
    from ds_ext.data import ByteCorpus
    from ds_ext.integration.ds_engine import disable_jit_builds

    torch.cuda.current_device = lambda: "cpu"  # see the module docstring
    if pipe or its_loop:  # get_batch(_pipe) -> mpu.broadcast_data builds its buffers with CUDA-only calls
        torch.cuda.LongTensor = torch.LongTensor
        torch.Tensor.cuda = lambda self, *a, **kw: self
    masks, its_names = [], (neox_training.cross_entropy, neox_training.get_batch)
    if its_loop:  # the test's own names in GPT-NeoX's training module, put back below
        neox_training.cross_entropy = partial(_recording, neox_training.cross_entropy, masks)
        if hand_mask:
            neox_training.get_batch = partial(_hand_masked_batch, neox_training.get_batch, *hand_mask)
    args = _neox_args(zero_topo, model_parallel, stage, clip, pipe, extra)
    disable_jit_builds()
    deepspeed.init_distributed(dist_backend=args.distributed_backend, auto_mpi_discovery=False)
    world = dist.get_world_size()
    mp = args.model_parallel_size if args.model_parallel_size >= 1 else 1  # megatron/initialize.py's topology
    pp = args.pipe_parallel_size if args.pipe_parallel_size >= 1 else 1
    mpu.initialize_model_parallel(
        args.model_parallel_size,
        topology=PipeModelDataParallelTopology(num_pp=pp, num_mp=mp, num_dp=world // (mp * pp)),
        fp32_allreduce=args.fp32_allreduce,
    )
    setup_deepspeed_random_and_activation_checkpointing(neox_args=args)
    _set_random_seed(args.seed)
    mpu.model_parallel_cuda_manual_seed(args.seed)  # _set_random_seed does this where CUDA devices exist
    neox_model = get_model(neox_args=args)
    optimizer, param_groups = get_optimizer(model=neox_model, neox_args=args)
    lr_scheduler = get_learning_rate_scheduler(optimizer=optimizer, neox_args=args)
    ds_ext.patch_deepspeed()
    try:  # megatron/training.py:1188, verbatim
        model, optimizer, _, lr_scheduler = deepspeed.initialize(
            model=neox_model,
            optimizer=optimizer,
            args=args,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
            model_parameters=param_groups if optimizer is None else None,
            mpu=mpu if not args.is_pipe_parallel else None,
        )
    finally:
        ds_ext.unpatch_deepspeed()
    if args.is_pipe_parallel:  # megatron/training.py:1213
        model.set_has_attention_mask(True)
        batch_fn = partial(get_batch_pipe, neox_args=args, curr_scheduler=None)
        model.set_batch_fn(partial(_hand_masked, batch_fn, *hand_mask) if hand_mask else batch_fn)

    def parameters():
        gathered = model.ds_ext.gathered_parameters() if zero_topo else None
        with gathered if gathered is not None else torch.no_grad():
            return {n: p.detach().clone() for n, p in model.module.named_parameters()}

    init = parameters() if params else None
    corpus = ByteCorpus(max_bytes=200_000)
    data_rank, data_size = mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()
    losses, norms = [], []
    for step in range(steps):
        if args.is_pipe_parallel:  # train_step_pipe: the data iterator yields GPT-NeoX's {"text": ...} batches
            micro = [
                {"text": corpus.micro_batch(step + offset, m, data_rank, data_size, 2, ACCUM, args.seq_length)}
                for m in range(ACCUM)
            ]
            losses.append(float(model.train_batch(data_iter=iter(micro))))
            norms.append(model.get_global_grad_norm())
            continue
        x = corpus.micro_batch(step + offset, 0, data_rank, data_size, 2, 1, args.seq_length)
        if its_loop:  # train_step's body at gradient_accumulation_steps 1
            loss, _ = neox_training.forward_step(
                data_iterator=iter([{"text": x}]), model=model, neox_args=args, timers=None, is_train=True
            )
            model.backward(loss)
            model.step()
            losses.append(loss.item())
            norms.append(model.get_global_grad_norm())
            continue
        tokens, labels = x[:, :-1].contiguous(), x[:, 1:].contiguous()
        attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(tokens, args.tokenizer.eod)
        loss = cross_entropy(model((tokens, position_ids, attention_mask)), (labels, loss_mask))
        model.backward(loss)
        model.step()
        losses.append(loss.item())
        norms.append(model.get_global_grad_norm())
    info = {
        "config": type(args.deepspeed_config).__name__,
        "section": args.deepspeed_config.get("optimizer", {}).get("type"),
        "optimizer": type(optimizer).__name__,
        "plugins": [p.name for p in model.ds_ext.plugins],
        "inner": type(
            model.optimizer.inner if zero_topo else getattr(model.optimizer, "optimizer", model.optimizer)
        ).__name__,
        "stage": model.zero_optimization_stage(),
        "wrapper": type(model.optimizer).__name__,
        "data": (data_rank, data_size),
        "model": (mpu.get_model_parallel_rank(), mpu.get_model_parallel_world_size()),
        "masks": masks,
    }
    if params:
        end = parameters()
        info |= {
            "params": end,
            "still": [n for n, p in end.items() if torch.equal(p, init[n])],
            "norms": [None if n is None else float(n) for n in norms],
        }
    model.destroy()
    neox_training.cross_entropy, neox_training.get_batch = its_names
    mpu.destroy_model_parallel()
    dist.barrier()
    return losses, info


def _hand_masked(batch_fn, k, h, data):
    """GPT-NeoX's pipeline batch with its ``loss_mask`` multiplied by the hand-written Goldfish rule
    (tests/goldfish_reference.py) on the labels: the reference for ``"goldfish"``."""
    import torch
    from goldfish_reference import reference_keep

    inputs, (labels, loss_mask) = batch_fn(data)
    keep = torch.tensor([reference_keep(row, k, h) for row in labels.tolist()], dtype=loss_mask.dtype)
    return inputs, (labels, loss_mask * keep)


def _hand_masked_batch(get_batch, k, h, neox_args, data_iterator):
    """GPT-NeoX's ``get_batch`` with its ``loss_mask`` multiplied by the hand-written Goldfish rule on
    the labels (tests/goldfish_reference.py): the plain path's reference for ``"goldfish"``."""
    import torch
    from goldfish_reference import reference_keep

    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(
        neox_args=neox_args, data_iterator=data_iterator
    )
    keep = torch.tensor([reference_keep(row, k, h) for row in labels.tolist()], dtype=loss_mask.dtype)
    return tokens, labels, loss_mask * keep, attention_mask, position_ids


def _recording(cross_entropy, masks, output, labels, **kwargs):
    """GPT-NeoX's ``cross_entropy``, keeping each ``loss_mask`` it is given."""
    masks.append(labels[1].detach().clone())
    return cross_entropy(output, labels, **kwargs)


def test_neox_trains_zero_topo_with_its_own_optimizer_and_config_section(world):
    """GPT-NeoX's optimizer object and its ds_config ``optimizer`` section together: the
    client optimizer is used (as DeepSpeed does), and 5 steps equal plain data
    parallelism (DeepSpeed stage 0 through the same GPT-NeoX code) to 1e-6 in fp32."""
    plain = world.run(_neox_train, None)
    ours = world.run(_neox_train, {"preset": "zero_topo", **UNQUANTIZED})
    for (a, info), (b, _) in zip(ours, plain):
        assert info["config"] == "dict" and info["section"] == "Adam"  # GPT-NeoX always writes the section
        assert info["plugins"] == ["zero_topo"] and info["inner"] == "FusedAdam"
        assert a == pytest.approx(b, rel=1e-6, abs=0)
    assert plain[0][0][-1] < plain[0][0][0] - 0.5


TP2 = dict(model_parallel=2, clip=0.05, params=True)  # WORLD_SIZE 4: tensor 2 x data 2


@pytest.fixture(scope="module")
def zero1_tp2(world):
    """DeepSpeed ZeRO-1 through the same GPT-NeoX code at model_parallel_size 2 (its FusedAdam)."""
    return world.run(_neox_train, None, stage=1, **TP2)


def test_neox_tp2_unquantized_zero_topo_equals_deepspeed_zero1(world, zero1_tp2):
    """``model_parallel_size: 2``, ``pipe_parallel_size: 0`` (4 ranks: tensor 2 over each GCD pair,
    data 2 across the nodes): unquantized ZeRO-topo equals DeepSpeed ZeRO-1 under the same model
    parallelism to 1e-6 in fp32: losses, global gradient norms (clipping at 0.05 active on every
    step) and every parameter of every rank at the end, all of which moved."""
    ours = world.run(_neox_train, {"preset": "zero_topo", **UNQUANTIZED}, **TP2)
    for rank, ((a, mine), (b, ref)) in enumerate(zip(ours, zero1_tp2)):
        assert ref["stage"] == 1 and ref["wrapper"] == "DeepSpeedZeroOptimizer" and ref["inner"] == "FusedAdam"
        assert mine["stage"] == 0 and mine["plugins"] == ["zero_topo"] and mine["inner"] == "FusedAdam"
        assert mine["model"] == ref["model"] == (rank % 2, 2) and mine["data"] == ref["data"] == (rank // 2, 2)
        assert a == pytest.approx(b, rel=1e-6, abs=1e-6)
        assert mine["norms"] == pytest.approx(ref["norms"], rel=1e-6, abs=1e-6)
        assert min(ref["norms"]) > TP2["clip"]
        assert mine["params"].keys() == ref["params"].keys()
        for name, p in ref["params"].items():
            torch_close(mine["params"][name], p, name)
        assert mine["still"] == [] and ref["still"] == []


def test_neox_tp2_quantized_default_trains_within_the_seed_spread(world, zero1_tp2):
    """The default (quantized) preset at ``model_parallel_size: 2``: every parameter moves, and
    each step's loss is within the spread between ZeRO-1 runs on two data orders."""
    other = world.run(_neox_train, None, stage=1, offset=1000, **TP2)
    ours = world.run(_neox_train, {"preset": "zero_topo"}, **TP2)
    for (q, mine), (r0, _), (r1, _) in zip(ours, zero1_tp2, other):
        spread = max(abs(x - y) for x, y in zip(r0, r1))
        assert mine["still"] == []
        assert max(abs(x - y) for x, y in zip(q, r0)) <= spread


@pytest.mark.parametrize("pipe,model_parallel", [(1, 1), (2, 1), (1, 2)])
def test_neox_pipeline_path_zero_topo_pipeline_form_equals_deepspeed_zero1(world, pipe, model_parallel):
    """``pipe_parallel_size`` 1 and 2 (GPT-NeoX builds ``GPT2ModelPipe``, DeepSpeed runs its
    PipelineEngine; ``model_parallel_size`` 1 and 2): ZeRO-topo's pipeline form, unquantized,
    equals DeepSpeed ZeRO-1 on the same PipelineEngine to 1e-6 in fp32: losses,
    global norms (clipping at 0.05 active) and every parameter of every rank, all of which moved."""
    run = dict(model_parallel=model_parallel, clip=0.05, params=True, pipe=pipe, steps=4)
    ref = world.run(_neox_train, None, stage=1, **run)
    ours = world.run(_neox_train, {"preset": "zero_topo", "gradients": {"bits": 16, "hops": 1}}, **run)
    for (a, mine), (b, theirs) in zip(ours, ref):
        assert mine["stage"] == 0 and mine["plugins"] == ["zero_topo"] and theirs["stage"] == 1
        assert a == pytest.approx(b, rel=1e-6, abs=1e-6)
        assert mine["norms"] == pytest.approx(theirs["norms"], rel=1e-6, abs=1e-6)
        assert min(theirs["norms"]) > run["clip"]
        assert mine["params"].keys() == theirs["params"].keys()
        for name, p in theirs["params"].items():
            torch_close(mine["params"][name], p, name)
        assert mine["still"] == [] and theirs["still"] == []


def torch_close(actual, expected, name):
    import torch

    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6, msg=lambda m: f"{name}: {m}")
