"""Frontier launch scripts (issue 11, item 5) run against a simulated Slurm: a fake ``srun``
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
import os, subprocess, sys
args = sys.argv[1:]
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
