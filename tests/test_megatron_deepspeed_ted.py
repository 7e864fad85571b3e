"""The acceptance run: the real Megatron-DeepSpeed ``pretrain_gpt.py`` with TED.

4 ranks, tensor-parallel 2, expert-parallel 2, both expert modes (``--enable-expert-tensor-parallelism``
and its default, experts whole), with and without Megatron's recompute, under
``python -m ds_ext.run`` (examples/megatron_deepspeed_ted.sh), 10 iterations, ZeRO 0 +
gradient_clipping 1.0: the printed lm losses equal the same run with DTD / CAC off, and the
serial reference within fp32 tolerance: the same script on one rank, tensor- and
expert-parallel 1, its MoE layers computed by tests/moe_reference.py
(tests/megatron_serial_reference.py), the two data shards as two micro-batches. Split experts:
both sides draw the whole weights (``--use-cpu-initialization``); whole experts: the client cannot
(examples/megatron_deepspeed_ted.sh), so the serial run starts from the TED run's initial weights
(tests/megatron_dump_init.py).

Needs what the example script needs (its header): ``MDS`` (a copy of the client with its data
helpers built), ``DS0196`` (deepspeed 0.19.6, which the client imports), ``EXTRA`` (nltk,
pybind11, an import-only torchvision) and ``DATA`` (a NullTokenizer dataset); skipped
otherwise. About 8 minutes on 2 cores: not part of the quick suite's budget.
"""

import os
import subprocess
from pathlib import Path

import pytest
from clients import MDS_ENV as ENV
from clients import MDS_READY, MDS_SKIP
from clients import lm_losses as _losses

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not MDS_READY, reason=MDS_SKIP)
SERIAL_ARGS = [
    "--tensor-model-parallel-size",
    "1",
    "--moe-expert-parallel-size",
    "1",
    "--num-experts",
    "2",
    "--topk",
    "1",
    "--moe-train-capacity-factor",
    "1.0",
    "--moe-min-capacity",
    "0",
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "64",
    "--max-position-embeddings",
    "64",
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "2",
    "--train-iters",
    "10",
    "--lr",
    "1e-3",
    "--min-lr",
    "1e-4",
    "--lr-decay-style",
    "constant",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "512",
    "--split",
    "98,2,0",
    "--deepspeed",
    "--no-pipeline-parallel",
    "--distributed-backend",
    "gloo",
    "--log-interval",
    "1",
    "--eval-interval",
    "1000",
    "--eval-iters",
    "0",
    "--seed",
    "1234",
    "--use-cpu-initialization",
    # the vocabulary TP 2 pads to (128 x 2), so the serial run has the same embedding
    "--make-vocab-size-divisible-by",
    "256",
    "--no-masked-softmax-fusion",
    "--no-bias-gelu-fusion",
    "--no-bias-dropout-fusion",
    "--no-gradient-accumulation-fusion",
    "--attention-dropout",
    "0",
    "--hidden-dropout",
    "0",
]


def _ted(etp: int, recompute: int, mode: str, dump: Path | None = None, *args: str, **env_extra: str) -> list[float]:
    env = {**os.environ, **ENV, **({"TED_INIT_DUMP": str(dump)} if dump else {}), **env_extra}
    run = subprocess.run(
        ["bash", str(REPO / "examples" / "megatron_deepspeed_ted.sh"), str(etp), str(recompute), mode, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return _losses(run.stdout)


def _serial(directory: Path, **reference: str) -> list[float]:
    """lm losses of the serial reference run (one rank, plain DeepSpeed 0.19.6, no ds_ext)."""
    cfg = directory / "ds.json"
    cfg.write_text(
        '{"train_batch_size": 2, "train_micro_batch_size_per_gpu": 1, "steps_per_print": 1, '
        '"zero_optimization": {"stage": 0}, "gradient_clipping": 1.0}'
    )
    env = {
        **os.environ,
        "PYTHONPATH": f"{ENV['DS0196']}:{ENV['EXTRA']}:{ENV['MDS']}",
        "OMP_NUM_THREADS": "1",
        "DS_ACCELERATOR": "cpu",
        "LOCAL_SIZE": "1",
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",
        "REFERENCE_DATA_SHARDS": "2",
        "REFERENCE_TENSOR_PARALLEL": "2",
        **reference,
    }
    run = subprocess.run(
        [
            "torchrun",
            "--standalone",
            "--nproc_per_node",
            "1",
            str(REPO / "tests" / "megatron_serial_reference.py"),
            "pretrain_gpt.py",
            *SERIAL_ARGS,
            "--data-path",
            ENV["DATA"],
            "--deepspeed_config",
            str(cfg),
        ],
        cwd=ENV["MDS"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return _losses(run.stdout)


@pytest.fixture(scope="module")
def serial_from_cpu_init(tmp_path_factory):
    """The serial run from the whole weights ``--use-cpu-initialization`` draws (split experts)."""
    return _serial(tmp_path_factory.mktemp("serial"))


@pytest.mark.parametrize("recompute", [0, 1], ids=["no-recompute", "megatron-recompute"])
@pytest.mark.parametrize("etp", [1, 0], ids=["experts-split", "experts-whole"])
def test_pretrain_gpt_tp2_ep2_equals_off_and_serial_reference(request, tmp_path, etp, recompute):
    dump = None if etp else tmp_path / "init"  # whole experts: the serial run starts from the TED run's weights
    on = _ted(etp, recompute, "on", dump)
    off = _ted(etp, recompute, "off" if etp else "cac-off")  # whole experts need DTD (refused without)
    assert on == off  # as printed: 7 significant digits
    serial = request.getfixturevalue("serial_from_cpu_init") if etp else _serial(tmp_path, REFERENCE_INIT=str(dump))
    assert on == pytest.approx(serial, rel=2e-5, abs=0)
    assert on[-1] < on[0]


@pytest.mark.parametrize("etp", [1, 0], ids=["experts-split", "experts-whole"])
def test_zero_topo_beside_ted_equals_ted_with_deepspeed_zero1(etp):
    """8 ranks (tensor 2 x expert 2 x expert-data 2, global batch 4), experts split over
    the tensor group (``--enable-expert-tensor-parallelism``) or whole (the client's default): TED
    with ZeRO-topo unquantized (the dense part sharded over the data group, the experts over their
    expert-data group; whole experts over tensor x expert-data) prints the lm losses of TED with
    DeepSpeed's own ZeRO-1 (MoE param groups, ``--create-moe-param-group``) within 1e-6, 10
    iterations, clipping at 1.0."""
    ref = _ted(etp, 0, "zero1")
    ours = _ted(etp, 0, "zero-topo")
    assert len(ours) == len(ref) == 10
    assert ours == pytest.approx(ref, rel=1e-6, abs=0)


@pytest.mark.parametrize(
    "tp,etp,clip",
    [("1", 0, "1.0"), ("2", 1, "0.0")],
    ids=["tp1-clipped", "tp2-experts-split"],
)
def test_ted_on_the_pipeline_engine_equals_deepspeed_moe(tp, etp, clip):
    """The client's default path, GPTModelPipe on DeepSpeed's PipelineEngine (PP 2, 8 ranks, ZeRO-1
    with MoE param groups, every layer MoE, dropless at TP 1 and a capacity no token overflows at TP 2,
    where DeepSpeed's expert tensor parallelism needs token dropping): TED prints the lm losses of
    DeepSpeed's own MoE within 1e-6, 10 iterations. At TP 2 without clipping: there DeepSpeed-MoE's
    ZeRO-1 norm leaves out tensor rank 1's experts; the clipped case is the next test."""
    routing = ["--expert-interval", "1"] + (
        ["--disable-moe-token-dropping"] if tp == "1" else ["--moe-train-capacity-factor", "4"]
    )
    env = {"PP": "2", "TP": tp, "CLIP": clip}
    ref = _ted(etp, 0, "zero1-deepspeed", None, *routing, **env)
    ours = _ted(etp, 0, "zero1", None, *routing, **env)
    assert len(ours) == len(ref) == 10
    assert ours == pytest.approx(ref, rel=1e-6, abs=0)
    assert ours[-1] < ours[0]


def _norm_of_distinct_gradients(dumps: list[dict]) -> float:
    """The 2-norm of a model's gradient from every rank's dump (tests/megatron_dump_grads.py), each
    element once, read from the values alone: a parameter's gradients on all ranks are grouped by
    name and each distinct tensor counted once. Replicas (data-parallel, tensor-replicated, tied over
    the stages) are bit-identical copies after their reductions; shards of a tensor-parallel or
    expert-parallel parameter differ."""
    import math

    import torch

    names = {n for d in dumps for n in d["grads"]}
    total = 0.0
    for name in names:
        distinct: list = []
        for g in (d["grads"][name] for d in dumps if name in d["grads"]):
            if not any(g.shape == h.shape and torch.equal(g, h) for h in distinct):
                distinct.append(g)
        total += sum(float(g.double().square().sum()) for g in distinct)
    return math.sqrt(total)


def test_ted_on_the_pipeline_engine_clips_by_the_norm_of_its_gradients(tmp_path):
    """PP 2, TP 2, experts split over the tensor group, clipping at 1.0 (8 ranks): TED's gradients of
    the first step equal DeepSpeed-MoE's rank by rank and name by name (ZeRO stage 0, where both keep
    them whole), and the norm TED clips by, at stage 0 (its own) and under DeepSpeed's ZeRO-1 (its
    partitioned norm over TED's parameter marks), equals the norm of those gradients counted once
    each, within 1e-6; TED's ZeRO-1 run prints its stage-0 run's losses. DeepSpeed-MoE's own ZeRO-1
    norm is not the reference here: it leaves out tensor rank 1's expert shards (docs/plugins/ted.md,
    On the PipelineEngine)."""
    import torch

    routing = ["--expert-interval", "1", "--moe-train-capacity-factor", "4"]
    env = {"PP": "2", "TP": "2", "CLIP": "1.0"}
    losses, dumps = {}, {}
    for name, mode, stage in (
        ("deepspeed", "zero1-deepspeed", "0"),
        ("ted", "zero1", "0"),
        ("ted_zero1", "zero1", "1"),
    ):
        out = tmp_path / name
        losses[name] = _ted(1, 0, mode, None, *routing, STAGE=stage, TED_GRAD_DUMP=str(out), **env)
        dumps[name] = [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(8)]
    for ds, ted in zip(dumps["deepspeed"], dumps["ted"]):
        assert ted["grads"].keys() == ds["grads"].keys()
        for n, g in ds["grads"].items():
            torch.testing.assert_close(ted["grads"][n], g, rtol=1e-6, atol=1e-8, msg=n)
    reference = _norm_of_distinct_gradients(dumps["deepspeed"])
    assert reference > 1.0  # clipping is active at the first step
    for run in ("ted", "ted_zero1"):
        assert [d["norm"] for d in dumps[run]] == pytest.approx([reference] * 8, rel=1e-6), run
    assert losses["ted_zero1"] == pytest.approx(losses["ted"], rel=1e-6, abs=0)
