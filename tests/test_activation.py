"""ds_ext without editing the script (items 1-3): ``ds_ext.patch_deepspeed`` /
``python -m ds_ext.run`` route ``deepspeed.initialize`` through ds_ext; GPT-NeoX's and
Megatron-DeepSpeed's call shapes train exactly like a direct ``ds_ext.initialize``; an
ignored ``"ds_ext"`` block is reported; an unmodified DeepSpeed script launched the
documented way prints the same losses and traffic table as the ds_ext example.

References: the direct ``ds_ext.initialize`` run (same model, data, config), and
``examples/train.py`` launched by the real ``deepspeed`` launcher.
"""

import base64
import json
import os
import re
import socket
import subprocess
import sys
import warnings
from argparse import Namespace
from pathlib import Path

import pytest
import torch

WORLD_SIZE = 4
ROOT = Path(__file__).resolve().parents[1]
CONFIG = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 0},
    "steps_per_print": 10**9,
    "ds_ext": {
        "topology": {"preset": "frontier", "sizes": {"gpu": 1}, "emulate": True},
        "zero_topo": {"enabled": True, "preset": "zero_topo"},
    },
}


def test_run_hands_launcher_options_to_the_script():
    from ds_ext.run import ScriptError, _split

    assert _split(["--local_rank=3", "train.py", "--x", "1"]) == (["--local_rank=3"], "train.py", False, ["--x", "1"])
    assert _split(["--", "train.py"]) == ([], "train.py", False, [])
    assert _split(["-m", "pkg.train", "--y"]) == ([], "pkg.train", True, ["--y"])
    with pytest.raises(ScriptError, match="no script given; usage"):
        _split(["--local_rank=0"])


def test_base64_and_hjson_configs_load_like_deepspeed(tmp_path):
    from ds_ext.config import DsExtConfigError, load_ds_config

    encoded = base64.urlsafe_b64encode(json.dumps(CONFIG).encode()).decode()
    assert load_ds_config(encoded) == CONFIG
    path = tmp_path / "cfg.json"
    path.write_text('{\n  // a comment, as DeepSpeed (hjson) allows\n  "train_batch_size": 8\n}\n')
    assert load_ds_config(str(path)) == {"train_batch_size": 8}
    with pytest.raises(DsExtConfigError, match="does not exist"):
        load_ds_config(str(tmp_path / "missing.json"))


# ---- call shapes on 4 ranks -----------------------------------------------------------------
class _DataParallelMpu:
    """What GPT-NeoX / Megatron hand DeepSpeed at tensor and pipeline parallel size 1."""

    def __init__(self):
        import torch.distributed as dist

        self._alone = None
        for r in range(dist.get_world_size()):  # every rank creates every group
            g = dist.new_group([r])
            if r == dist.get_rank():
                self._alone = g

    def get_model_parallel_world_size(self):
        return 1

    get_tensor_model_parallel_world_size = get_model_parallel_world_size

    def get_pipeline_model_parallel_world_size(self):
        return 1

    def get_model_parallel_rank(self):
        return 0

    get_tensor_model_parallel_rank = get_model_parallel_rank

    def get_model_parallel_group(self):
        return self._alone

    get_tensor_model_parallel_group = get_model_parallel_group

    def get_data_parallel_world_size(self):
        import torch.distributed as dist

        return dist.get_world_size()

    def get_data_parallel_rank(self):
        import torch.distributed as dist

        return dist.get_rank()

    def get_data_parallel_group(self):
        import torch.distributed as dist

        return dist.group.WORLD


def _model_and_optimizer():
    from ds_ext.models import GPT, GPTConfig

    torch.manual_seed(1234)
    model = GPT(GPTConfig(seq_len=32, d_model=64, n_layers=2, n_heads=4))
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3)


def _train(engine, steps=3):
    """``steps`` steps of 2 micro-batches (the call shapes are compared exactly: a difference
    in what reaches ds_ext shows from the first step; 3 leave the traffic of 2 after skip=1)."""
    import torch.distributed as dist

    from ds_ext.data import ByteCorpus

    corpus = ByteCorpus(max_bytes=200_000)
    losses = []
    for step in range(steps):
        for m in range(2):
            loss = engine(corpus.micro_batch(step, m, dist.get_rank(), dist.get_world_size(), 2, 2, 32))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses


def _shape(kind):
    import deepspeed

    import ds_ext

    model, opt = _model_and_optimizer()
    if kind == "direct":
        engine, *_ = ds_ext.initialize(model=model, optimizer=opt, config=CONFIG)
    else:
        ds_ext.patch_deepspeed()
        try:
            if kind == "neox":  # megatron/training.py: config in args.deepspeed_config as urlsafe base64
                args = Namespace(
                    deepspeed_config=base64.urlsafe_b64encode(json.dumps(CONFIG).encode()).decode(),
                    local_rank=int(os.environ["LOCAL_RANK"]),
                )
                engine, *_ = deepspeed.initialize(
                    model=model,
                    optimizer=opt,
                    args=args,
                    lr_scheduler=None,
                    dist_init_required=False,
                    model_parameters=model.parameters(),
                    mpu=_DataParallelMpu(),
                )
            else:  # Megatron-DeepSpeed: config dict, args.deepspeed_config cleared, an mpu
                args = Namespace(deepspeed_config=None, local_rank=int(os.environ["LOCAL_RANK"]))
                engine, *_ = deepspeed.initialize(
                    model=model,
                    optimizer=opt,
                    args=args,
                    lr_scheduler=None,
                    mpu=_DataParallelMpu(),
                    config=dict(CONFIG),
                )
        finally:
            ds_ext.unpatch_deepspeed()
    assert engine.ds_ext.plugins[0].name == "zero_topo"
    losses = _train(engine)
    traffic = engine.ds_ext.ledger.mean_by_level(skip=1)
    engine.destroy()
    return losses, traffic


_DIRECT = []  # the direct ds_ext.initialize run, the reference of both call shapes


@pytest.mark.parametrize("kind", ["neox", "megatron_deepspeed"])
def test_neox_and_megatron_deepspeed_call_shapes_train_like_ds_ext_initialize(world, kind):
    if not _DIRECT:
        _DIRECT.append(world.run(_shape, "direct"))
    direct = _DIRECT[0]
    shaped = world.run(_shape, kind)
    for (a, ta), (b, tb) in zip(shaped, direct):
        assert a == b and ta == tb  # exactly: the same run
    assert direct[0][0][-1] < direct[0][0][0]


def _ignored_block():
    import deepspeed

    from ds_ext.entry import activation
    from ds_ext.integration import ds_engine

    ds_engine.disable_jit_builds()  # DeepSpeed alone would build its shm op (when this test runs first)
    activation.patch_deepspeed()  # importing ds_ext wraps nothing: activation does
    activation.unpatch_deepspeed()
    model, opt = _model_and_optimizer()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=dict(CONFIG))
    plain = [str(w.message) for w in caught if "is ignored" in str(w.message)]
    out = (plain, hasattr(engine, "ds_ext"), activation.active())
    engine.destroy()
    return out


def test_an_ignored_ds_ext_block_is_reported(world):
    """ds_ext activated, then switched off: DeepSpeed would silently keep the block."""
    from ds_ext.entry.activation import IGNORED

    for rank, (messages, has_ds_ext, active) in enumerate(world.run(_ignored_block)):
        assert not active and not has_ds_ext
        assert messages == ([IGNORED] if rank == 0 else [])  # once, from rank 0


# ---- the documented launch of an unmodified script --------------------------------------------
# 2 ranks a job (1 node x 1 GPU x 2 GCDs under CONFIG's topology): what is compared is each job's
# whole output, which a rank count does not make more or less alike; the 4-rank world above covers
# the call shapes, and each rank a launcher starts imports DeepSpeed and ds_ext anew
LAUNCH_RANKS = 2


def _launch(script, config, *extra):
    """Start the launcher on ``script``; returns a function that waits for it and returns its stdout."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [
        "deepspeed",
        "--num_gpus",
        str(LAUNCH_RANKS),
        "--master_port",
        str(port),
        *extra,
        script,
        "--deepspeed_config",
        str(config),
        "--steps",
        "3",
        "--d-model",
        "64",
        "--layers",
        "2",
        "--seq-len",
        "32",
        "--log-losses",
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def result():
        try:
            stdout, stderr = proc.communicate(timeout=600)
        finally:
            if proc.poll() is None:  # timed out, or the caller gave up on it
                proc.kill()
                proc.wait()
        assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
        return stdout

    result.stop = proc.kill  # type: ignore[attr-defined]
    return result


def _losses_and_table(stdout):
    losses = re.findall(r"step \d+: loss [0-9.]+", stdout)
    start = stdout.rindex(f"frontier: world {LAUNCH_RANKS}")  # the traffic table at the end (the banner names it first)
    table = stdout[start:].splitlines()[:6]
    return losses, table


def test_unmodified_script_under_ds_ext_run_matches_the_ds_ext_example(tmp_path):
    config = tmp_path / "cfg.json"
    config.write_text(json.dumps(CONFIG))
    # the two jobs are independent: run side by side (each waits on its launcher's 1 s polls and rendezvous)
    ours, unmodified = (
        _launch("examples/train.py", config),
        _launch("examples/train_deepspeed.py", config, "--module", "ds_ext.run"),
    )
    try:
        ours = ours()
    finally:
        if not isinstance(ours, str):  # its launch failed: do not leave the other running
            unmodified.stop()
    unmodified = unmodified()
    assert "ds_ext: per-level traffic" in unmodified
    losses, table = _losses_and_table(ours)
    losses_u, table_u = _losses_and_table(unmodified)
    assert len(losses) == 3 and losses_u == losses
    assert table_u == table and table[1].startswith("level")


EXIT_SCRIPT = """
import atexit, sys
import torch.distributed as dist
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
atexit.register(lambda: print("initialized at exit:", dist.is_initialized(), flush=True))
sys.exit(int(sys.argv[1]))
"""


@pytest.mark.parametrize("status", [0, 3])
def test_ds_ext_run_destroys_the_process_groups_after_a_clean_run_only(tmp_path, status):
    """A clean exit leaves no gloo group to the interpreter's teardown (pytorch#190489); a failed
    one keeps its groups (destroying them could wait on peers stuck in a collective)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "exits.py"
    script.write_text(EXIT_SCRIPT.format(port=port))
    done = subprocess.run(
        [sys.executable, "-m", "ds_ext.run", str(script), str(status)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == status, done.stderr[-2000:]
    assert f"initialized at exit: {status != 0}" in done.stdout


def test_autoload_path_activates_ds_ext_in_every_process_without_importing_deepspeed(tmp_path):
    """For launchers that build the rank command themselves (GPT-NeoX's deepy.py):
    PYTHONPATH=$(ds-ext autoload-path) activates ds_ext at interpreter start, lazily."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    path = subprocess.run(["ds-ext", "autoload-path"], capture_output=True, text=True, env=env, timeout=120)
    assert path.returncode == 0, path.stderr
    env["PYTHONPATH"] = path.stdout.strip() + os.pathsep + env.get("PYTHONPATH", "")
    probe = (
        "import sys; before = ('deepspeed' in sys.modules, 'torch' in sys.modules); import deepspeed; "
        "from ds_ext.entry import activation; "
        "print(before, getattr(deepspeed.initialize, '__ds_ext_dispatcher__', False), activation.active())"
    )
    out = subprocess.run(["python", "-c", probe], capture_output=True, text=True, env=env, timeout=300, cwd="/")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "(False, False) True True"
    ted = Path(tmp_path) / "ted.json"
    ted.write_text(json.dumps(_ted_config(True)))
    probe = "import deepspeed.moe.layer as l; print(l.MoE.__module__)"
    for argv, want in (([], "deepspeed.moe.layer"), (["--deepspeed_config", str(ted)], "ds_ext.moe.layer")):
        out = subprocess.run(
            ["python", "-c", probe, *argv], capture_output=True, text=True, env=env, timeout=300, cwd="/"
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip().splitlines()[-1] == want


# ---- Megatron-DeepSpeed MoE: deepspeed.moe.layer.MoE becomes TEDMoE ---------------------------
MEGATRON_MOE_SCRIPT = '''
"""Megatron-DeepSpeed's MoE path in small: its own process groups and mpu (tensor innermost),
``deepspeed.moe.layer.MoE`` built with the model (megatron/model/transformer.py), MoE param
groups, the config loaded from --deepspeed_config and passed as a dict with
args.deepspeed_config = None (megatron/training.py)."""
import argparse
import json
import os

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.moe.layer import MoE
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
p.add_argument("--out", required=True)
p.add_argument("--explicit", action="store_true", help="the reference: TEDMoE written into the script")
args = deepspeed.add_config_arguments(p).parse_args()
if args.explicit:
    from ds_ext.moe import TEDMoE as MoE
config = json.load(open(args.deepspeed_config))
args.deepspeed_config = None
TP, rank, world = 2, dist.get_rank(), dist.get_world_size()
tensor_groups = [dist.new_group(list(range(i, i + TP))) for i in range(0, world, TP)]
data_groups = [dist.new_group(list(range(t, world, TP))) for t in range(TP)]


class Mpu:
    def get_model_parallel_group(self):
        return tensor_groups[rank // TP]

    def get_model_parallel_world_size(self):
        return TP

    def get_model_parallel_rank(self):
        return rank % TP

    def get_data_parallel_group(self):
        return data_groups[rank % TP]

    def get_data_parallel_world_size(self):
        return world // TP

    def get_data_parallel_rank(self):
        return rank // TP


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1234)
        self.emb = nn.Embedding(64, 32)
        self.moe = MoE(32, nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)), num_experts=2,
                       ep_size=2, k=1, capacity_factor=2.0, enable_expert_tensor_parallelism=True)
        self.head = nn.Linear(32, 64)

    def forward(self, x):
        h = self.emb(x[:, :-1])
        out, l_aux, _ = torch.utils.checkpoint.checkpoint(self.moe, h, use_reentrant=False)
        return F.cross_entropy(self.head(h + out).flatten(0, 1), x[:, 1:].flatten()) + 0.01 * l_aux


model = Net()
groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "dense"})
engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(groups, lr=1e-2), args=args,
                                  mpu=Mpu(), config=config)
losses = []
for step in range(5):
    x = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(100 * step + rank // TP))
    loss = engine(x)
    engine.backward(loss)
    engine.step()
    losses.append(loss.item())
ted = engine.module.moe.ted
result = {"moe": f"{type(engine.module.moe).__module__}.{type(engine.module.moe).__name__}", "losses": losses,
          "dtd": ted.dtd, "cac": ted.cac, "bytes": engine.ds_ext.ledger.mean_by_level(skip=1)}
with open(f"{args.out}.{rank}.json", "w") as f:
    json.dump(result, f)
engine.destroy()
'''


def _ted_config(dtd_cac):
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 1},
        "steps_per_print": 10**9,
        "ds_ext": {
            "topology": {"preset": "frontier", "sizes": {"gpu": 1}, "emulate": True},
            "ted": {
                "enabled": True,
                "tensor_parallel": 2,
                "expert_parallel": 2,
                "duplicate_token_dropping": dtd_cac,
                "comm_aware_checkpointing": dtd_cac,
            },
        },
    }


def _run_moe_script(script, config, out, explicit):
    import deepspeed.moe.layer
    import torch.distributed as dist

    import ds_ext
    from ds_ext.run import main

    original = deepspeed.moe.layer.MoE
    try:
        main([script, "--deepspeed_config", config, "--out", out, *(["--explicit"] if explicit else [])])
    finally:
        deepspeed.moe.layer.MoE = original
        ds_ext.unpatch_deepspeed()
    return json.loads(Path(f"{out}.{dist.get_rank()}.json").read_text())


def test_megatron_deepspeed_moe_script_gets_tedmoe_from_the_config(world, tmp_path):
    """Under ``ds_ext.run`` with TED enabled in --deepspeed_config, a script
    building ``deepspeed.moe.layer.MoE`` and passing its own mpu trains TEDMoE exactly like
    the same script with TEDMoE written in; DTD and CAC follow the config."""
    script = tmp_path / "pretrain_moe.py"
    script.write_text(MEGATRON_MOE_SCRIPT)
    runs = {}
    for name, dtd_cac, explicit in (
        ("explicit", True, True),
        ("substituted", True, False),
        ("substituted_off", False, False),
    ):
        config = tmp_path / f"{name}.json"
        config.write_text(json.dumps(_ted_config(dtd_cac)))
        runs[name] = world.run(_run_moe_script, str(script), str(config), str(tmp_path / name), explicit)
    for ref, sub, off in zip(runs["explicit"], runs["substituted"], runs["substituted_off"]):
        assert sub["moe"] == ref["moe"] == off["moe"] == "ds_ext.moe.layer.TEDMoE"
        assert (sub["dtd"], sub["cac"], off["dtd"], off["cac"]) == (True, True, False, False)
        assert sub["losses"] == ref["losses"] == off["losses"]  # DTD and CAC are bit-identical
        assert sub["bytes"] == ref["bytes"] and off["bytes"] != sub["bytes"]
    assert runs["substituted"][0]["losses"][-1] < runs["substituted"][0]["losses"][0]


def test_moe_substitution_reads_the_command_line_config(tmp_path):
    import deepspeed.moe.layer

    from ds_ext.entry import moe_substitution as ms

    ted, plain = tmp_path / "ted.json", tmp_path / "plain.json"
    ted.write_text(json.dumps(_ted_config(True)))
    plain.write_text(json.dumps(CONFIG))
    b64 = base64.urlsafe_b64encode(json.dumps(_ted_config(True)).encode()).decode()
    assert ms.config_from_argv(["--x", "--deepspeed_config", "a.json", "--deepspeed-config=b.json"]) == "b.json"
    assert ms.config_from_argv(["--deepspeed"]) is None
    assert ms.ted_enabled(str(ted)) and ms.ted_enabled(b64) and not ms.ted_enabled(str(plain))
    assert not ms.ted_enabled(str(tmp_path / "missing.json"))
    original = deepspeed.moe.layer.MoE
    try:
        assert not ms.substitute_from_argv(["--deepspeed_config", str(plain)])
        assert deepspeed.moe.layer.MoE is original
        assert ms.substitute_from_argv(["--deepspeed_config", b64])
        assert deepspeed.moe.layer.MoE.__name__ == "TEDMoE" and issubclass(deepspeed.moe.layer.MoE, original)
    finally:
        deepspeed.moe.layer.MoE = original
