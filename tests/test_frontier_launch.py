"""Frontier launch scripts (item 5) run against a simulated Slurm: a fake ``srun``
starts every task with Slurm's variables and the GCD ``--gpu-bind=closest`` picks on
Frontier (7 cores per task in order: local tasks 0..7 get GCDs 4 5 2 3 6 7 0 1), a fake
``python`` records each task's environment and arguments, a fake ``scontrol`` lists hosts.

Checked: the ranks, node-major order, that local ranks 2k, 2k+1 share an MI250X (the
"frontier" preset's gcd level), the variables ds_ext derives (or the Megatron script
exports), the AWS OFI RCCL plugin on the library path with no TCP fallback, and refusals.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest

from ds_ext.topology import Topology, detect_environment, slurm_rank_variables

ROOT = Path(__file__).resolve().parents[1]
NODES, PER_NODE = 2, 8
CLOSEST_GCD = [4, 5, 2, 3, 6, 7, 0, 1]  # Frontier: the GCD nearest to cores 8l+1 .. 8l+7

FAKE_SRUN = (
    r"""#!/usr/bin/env python3
import json, os, subprocess, sys
args = sys.argv[1:]
if os.environ.get("FAKE_SRUN_RECORD"):  # record the srun line only (allocations too large to start)
    with open(os.environ["FAKE_SRUN_RECORD"], "a") as f:
        f.write(json.dumps(args) + "\n")
    sys.exit(0)
per_node = 1
while args and args[0].startswith("--"):
    opt = args.pop(0)
    if opt.startswith("--ntasks-per-node="):
        per_node = int(opt.split("=")[1])
nodes = int(os.environ["SLURM_NNODES"])
for n in range(nodes):
    for l in range(per_node):
        env = dict(os.environ, SLURM_PROCID=str(n * per_node + l), SLURM_LOCALID=str(l), SLURM_NODEID=str(n),
                   SLURMD_NODENAME=f"frontier{n:05d}", SLURM_NTASKS=str(nodes * per_node),
                   SLURM_NTASKS_PER_NODE=f"{per_node}(x{nodes})")
        if per_node == 8:
            env["ROCR_VISIBLE_DEVICES"] = str(%s[l])
        subprocess.run(args, env=env, check=True)
"""
    % CLOSEST_GCD
)

FAKE_PYTHON = r"""#!/usr/bin/env python3
import json, os, sys
keep = ("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "NCCL_", "FI_", "MIOPEN_", "ROCR_", "LD_LIBRARY_PATH",
        "OMP_NUM_THREADS", "FAKE_VENV", "HSA_", "MPICH_")
rec = {"argv": sys.argv[1:], "env": {k: v for k, v in os.environ.items() if k.startswith(keep)}}
with open(os.path.join(os.environ["FAKE_OUT"], f"task{os.environ['SLURM_PROCID']}.json"), "w") as f:
    json.dump(rec, f)
"""

FAKE_SCONTROL = r"""#!/usr/bin/env bash
[[ "$1 $2" == "show hostnames" ]] || exit 1
for ((n = 0; n < SLURM_NNODES; n++)); do printf 'frontier%05d\n' "$n"; done
"""


@pytest.fixture
def slurm(tmp_path):
    """A fake Slurm allocation of 2 nodes; returns (run script, read tasks)."""
    bin_dir, out, venv, plugin = tmp_path / "bin", tmp_path / "out", tmp_path / "venv", tmp_path / "aws-ofi-rccl"
    for d in (bin_dir, out, venv / "bin", plugin / "lib"):
        d.mkdir(parents=True)
    for name, text in (("srun", FAKE_SRUN), ("python", FAKE_PYTHON), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    (venv / "bin" / "activate").write_text("export FAKE_VENV=active\n")
    (plugin / "lib" / "librccl-net.so").write_text("")
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "HOME": str(tmp_path),
        "USER": "me",
        "FAKE_OUT": str(out),
        "SLURM_JOB_NODELIST": "frontier[00000-00001]",
        "SLURM_NNODES": str(NODES),
        "SLURM_JOB_ID": "42",
        "SLURM_SUBMIT_DIR": str(ROOT),
        "DS_EXT_VENV": str(venv),
        "DS_EXT_RCCL_PLUGIN_DIR": str(plugin),
        "DS_EXT_MODULES": "",
        "MEGATRON_DS": "/opt/Megatron-DeepSpeed",
    }

    def run(script, *args, **overrides):
        return subprocess.run(
            ["bash", str(ROOT / "launch" / script), *args],
            env={**env, **overrides},
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=120,
        )

    def tasks():
        return [json.loads((out / f"task{r}.json").read_text()) for r in range(NODES * PER_NODE)]

    return run, tasks, plugin


@pytest.mark.parametrize("script", ["frontier.sbatch", "frontier_megatron.sbatch"])
def test_scripts_are_valid_bash(script):
    subprocess.run(["bash", "-n", str(ROOT / "launch" / script)], check=True)


TRANSPORT_001 = {
    "FI_CXI_RDZV_THRESHOLD": "0",
    "FI_CXI_RDZV_GET_MIN": "0",
    "FI_CXI_RDZV_EAGER_SIZE": "0",
    "NCCL_NET_GDR_LEVEL": "PHB",
    "HSA_ENABLE_SDMA": "0",
    "MPICH_OFI_NIC_POLICY": "USER",
    "MPICH_OFI_NIC_MAPPING": "0:0-1;1:2-3;2:4-5;3:6-7",
}


def _common_checks(tasks, plugin):
    topo = Topology.from_preset("frontier", NODES * PER_NODE)
    for r, task in enumerate(tasks):
        env = task["env"]
        assert env["FAKE_VENV"] == "active" and env["OMP_NUM_THREADS"] == "7"
        assert env["MASTER_ADDR"] == "frontier00000" and env["MASTER_PORT"] == "29500"
        assert env["LD_LIBRARY_PATH"].split(":")[0] == str(plugin / "lib")
        assert env["NCCL_NET"] == "AWS Libfabric" and env["FI_PROVIDER"] == "cxi"
        assert env["NCCL_SOCKET_IFNAME"] == "hsn0" and env["FI_CXI_ATS"] == "0"
        for key, value in TRANSPORT_001.items():  # 001 §6.1.1, as the dissertation writes them
            assert env[key] == value, key
        assert env["MIOPEN_USER_DB_PATH"] == env["MIOPEN_CUSTOM_CACHE_DIR"] == "/tmp/miopen-me-42"
        node, local = divmod(r, PER_NODE)  # node-major: rank = node * 8 + local
        assert (env["SLURM_NODEID"], env["SLURM_LOCALID"]) == (str(node), str(local))
        # the gcd level of the preset: ranks 2k and 2k+1 are the two GCDs of one MI250X
        gcd = int(env["ROCR_VISIBLE_DEVICES"])
        assert topo.coords(r)[0] == gcd % 2 and gcd // 2 == CLOSEST_GCD[local - local % 2] // 2


def test_frontier_sbatch_starts_one_rank_per_gcd_node_major(slurm):
    run, tasks, plugin = slurm
    done = run("frontier.sbatch", "configs/frontier_zero_topo.json", "--steps", "1000")
    assert done.returncode == 0, done.stderr
    tasks = tasks()
    _common_checks(tasks, plugin)
    for r, task in enumerate(tasks):
        assert task["argv"] == [
            "-u",
            "examples/train.py",
            "--deepspeed_config",
            "configs/frontier_zero_topo.json",
            "--steps",
            "1000",
        ]
        derived = slurm_rank_variables(task["env"])  # what ds_ext.initialize derives in the task
        assert derived == {"WORLD_SIZE": "16", "RANK": str(r), "LOCAL_RANK": str(r % 8), "LOCAL_SIZE": "8"}
        job = detect_environment({**task["env"], **derived})
        assert (job.world_size, job.rank, job.local_size, job.num_nodes) == (16, r, 8, 2)


def test_megatron_sbatch_exports_torch_variables_and_runs_through_ds_ext(slurm):
    run, tasks, plugin = slurm
    done = run("frontier_megatron.sbatch", "configs/frontier/gpt_175b_004.json", "--tensor-model-parallel-size", "4")
    assert done.returncode == 0, done.stderr
    tasks = tasks()
    _common_checks(tasks, plugin)
    for r, task in enumerate(tasks):
        env = task["env"]
        assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_SIZE"]) == (str(r), "16", str(r % 8), "8")
        assert task["argv"] == [
            "-u",
            "-m",
            "ds_ext.run",
            "/opt/Megatron-DeepSpeed/pretrain_gpt.py",
            "--deepspeed",
            "--deepspeed_config",
            "configs/frontier/gpt_175b_004.json",
            "--tensor-model-parallel-size",
            "4",
        ]


# recipe: (nodes, TP, PP, global batch), as configs/frontier/*.recipe and their ds_configs say
RECIPE_FILES = {
    "gpt_22b_004.recipe": (8, 2, 2, 640),
    "gpt_175b_004.recipe": (128, 4, 16, 640),
    "gpt_1t_004.recipe": (128, 8, 64, 3200),
}


def _value(argv, flag):
    return argv[argv.index(flag) + 1]


@pytest.mark.parametrize("plain", [False, True], ids=["ds_ext", "plain"])
@pytest.mark.parametrize("recipe", sorted(RECIPE_FILES))
def test_megatron_sbatch_runs_each_recipe_with_ds_ext_or_plain(slurm, tmp_path, recipe, plain):
    """``frontier_megatron.sbatch [--plain] RECIPE args...``: one srun line, 8 tasks per node, running
    the unmodified pretrain_gpt.py under ds_ext.run with the recipe's Megatron-DeepSpeed arguments,
    then the user's; the ds_config is the recipe's ZeRO-topo pipeline form in fp16, or with --plain
    its published DeepSpeed ZeRO-1, and agrees with the arguments (global batch, fp16)."""
    run, _, _ = slurm
    nodes, tp, pp, gbs = RECIPE_FILES[recipe]
    record = tmp_path / "srun.jsonl"
    flags = ["--plain"] if plain else []
    done = run(
        "frontier_megatron.sbatch",
        *flags,
        f"configs/frontier/{recipe}",
        "--train-iters",
        "10",
        SLURM_NNODES=str(nodes),
        FAKE_SRUN_RECORD=str(record),
    )
    assert done.returncode == 0, done.stderr
    *_, line = [json.loads(x) for x in record.read_text().splitlines()]
    assert line[:5] == [
        "--ntasks-per-node=8",
        "--gpus-per-task=1",
        "--gpu-bind=closest",
        "--cpus-per-task=7",
        "--cpu-bind=cores",
    ]
    cmd = line[line.index("/opt/Megatron-DeepSpeed/pretrain_gpt.py") :]
    assert "exec python -u -m ds_ext.run" in line[line.index("-c") + 1]
    config = _value(cmd, "--deepspeed_config")
    assert config == f"configs/frontier/{recipe.removesuffix('.recipe')}{'' if plain else '_zero_topo'}.json"
    assert (_value(cmd, "--tensor-model-parallel-size"), _value(cmd, "--pipeline-model-parallel-size")) == (
        str(tp),
        str(pp),
    )
    assert (_value(cmd, "--micro-batch-size"), _value(cmd, "--global-batch-size")) == ("1", str(gbs))
    assert {"--fp16", "--checkpoint-activations", "--deepspeed-activation-checkpointing"} <= set(cmd)
    assert cmd[-2:] == ["--train-iters", "10"]  # the user's arguments last
    ds = json.loads((ROOT / config).read_text())
    assert ds["train_batch_size"] == gbs and ds["fp16"]["enabled"] and "bf16" not in ds
    zero_topo = ds["ds_ext"].get("zero_topo", {})
    assert (ds["zero_optimization"]["stage"], zero_topo.get("enabled", False)) == ((1, False) if plain else (0, True))
    assert plain or zero_topo["form"] == "pipeline"


@pytest.mark.parametrize(
    "args,nodes,message",
    [
        (
            ["configs/frontier/gpt_22b_004.recipe"],
            "2",
            "recipe configs/frontier/gpt_22b_004.recipe runs on 8 nodes (sbatch -N 8); this allocation has 2",
        ),
        (
            ["--plain", "configs/frontier/gpt_175b_004.json"],
            "2",
            "--plain needs a recipe (configs/frontier/*.recipe), got configs/frontier/gpt_175b_004.json",
        ),
        (["configs/frontier/gpt_2t.recipe"], "2", "no recipe configs/frontier/gpt_2t.recipe"),
    ],
)
def test_megatron_sbatch_refuses_a_recipe_it_cannot_run(slurm, tmp_path, args, nodes, message):
    run, _, _ = slurm
    record = tmp_path / "srun.jsonl"
    done = run("frontier_megatron.sbatch", *args, SLURM_NNODES=nodes, FAKE_SRUN_RECORD=str(record))
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert not record.exists()  # refused before any srun


@pytest.mark.parametrize(
    "missing,message",
    [
        ("DS_EXT_RCCL_PLUGIN_DIR", "set DS_EXT_RCCL_PLUGIN_DIR to the aws-ofi-rccl installation"),
        ("DS_EXT_VENV", "set DS_EXT_VENV to the Python environment"),
        ("plugin_file", "librccl-net.so: build aws-ofi-rccl (libfabric) first"),
    ],
)
def test_refuses_to_start_without_the_plugin_or_the_environment(slurm, missing, message):
    run, tasks, plugin = slurm
    if missing == "plugin_file":
        (plugin / "lib" / "librccl-net.so").unlink()
        done = run("frontier.sbatch")
    else:
        done = run("frontier.sbatch", **{missing: ""})
    assert done.returncode != 0 and message in done.stderr, done.stderr


def _shrink(recipe: str, mode: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(ROOT / "examples" / "frontier_recipe_cpu.sh"), recipe, mode],
        env={**os.environ, "SHRINK_ONLY": "1"},
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )


@pytest.mark.parametrize("recipe", sorted(RECIPE_FILES))
def test_each_recipe_shrinks_to_8_cpu_ranks_keeping_what_it_fixes(recipe):
    """examples/frontier_recipe_cpu.sh (its runs: tests/test_megatron_deepspeed_zero_topo.py,
    opt-in): TP 2 x PP 2 x DP 2, the recipe's micro-batch, fp16 and activation checkpointing kept,
    2 x PP micro-batches per step; the recipe's ds_ext config or its published ZeRO-1 config; no fp16 in
    the fp32 modes."""
    want = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--num-layers", "4"]
    want += ["--micro-batch-size", "1", "--global-batch-size", "8"]
    flags = ["--fp16", "--checkpoint-activations", "--deepspeed-activation-checkpointing"]
    stem = f"configs/frontier/{recipe.removesuffix('.recipe')}"
    for mode, config, fp16 in (
        ("ds_ext", f"{stem}_zero_topo.json", True),
        ("plain", f"{stem}.json", True),
        ("unquantized-fp32", f"{stem}_zero_topo.json", False),
        ("plain-fp32", f"{stem}.json", False),
    ):
        done = _shrink(f"configs/frontier/{recipe}", mode)
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == [config, *want, *(flags if fp16 else flags[1:])]


def test_recipe_shrink_refuses_what_it_cannot_shrink(tmp_path):
    """An argument without a CPU shrink, and an unknown mode, are refused in one line."""
    recipe = tmp_path / "odd.recipe"
    text = (ROOT / "configs" / "frontier" / "gpt_22b_004.recipe").read_text()
    recipe.write_text(text.replace("--use-flash-attn-v2", "--use-flash-attn-v2 --num-experts 8"))
    done = _shrink(str(recipe), "ds_ext")
    assert (done.returncode, done.stderr) == (
        2,
        "frontier_recipe_cpu.sh: recipe argument --num-experts has no CPU shrink\n",
    )
    done = _shrink("configs/frontier/gpt_22b_004.recipe", "zero3")
    assert (done.returncode, done.stderr) == (2, "MODE: ds_ext | plain | unquantized-fp32 | plain-fp32 (got zero3)\n")
