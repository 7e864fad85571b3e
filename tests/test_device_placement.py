"""Tensors ds_ext creates itself live where their collective's backend takes them.

NCCL and RCCL refuse host tensors, and a CPU-only machine cannot notice a flag or a count made
on the host and handed to a collective: on gloo every tensor is a host tensor. A GPU run found
five (checkpoint agreement flags, the TED capacity agreement, 3D-PMM's gradient norm and matmul
tuning gather, PCCL's staging buffers; tests/test_gpu.py). So this test reads the library's
source: every torch factory call names its device (``backend_device()``, a tensor's
``.device``), except the host-side ones listed here with their reason.
"""

import ast
from collections import Counter
from pathlib import Path

FACTORIES = {
    "tensor",
    "zeros",
    "ones",
    "empty",
    "full",
    "arange",
    "randn",
    "rand",
    "randint",
    "as_tensor",
    "frombuffer",
    "linspace",
}
ROOT = Path(__file__).resolve().parents[1]
# gloo-only tools: the CPU benchmarks and the network-namespace cluster (its own processes)
HOST_PACKAGES = ("ds_ext/bench/", "ds_ext/cluster/")
HOST_SIDE = {  # (file, factory): (calls, why they stay on the host)
    ("ds_ext/data.py", "frombuffer"): (1, "the token corpus is host data; callers move batches"),
    ("ds_ext/data.py", "randint"): (1, "the token corpus is host data; callers move batches"),
    ("ds_ext/data.py", "arange"): (1, "the token corpus is host data; callers move batches"),
    ("ds_ext/moe/gate.py", "tensor"): (1, "the fp32 product of DeepSpeed's capacity formula, read by .item()"),
    ("ds_ext/optim/tiled.py", "tensor"): (1, "torch Adam's own host step counter (Adam._init_group)"),
    ("ds_ext/pmm/init_replay.py", "empty"): (3, "replays the serial CPU initialisation; DeepSpeed moves the shards"),
    ("ds_ext/pmm/layout.py", "arange"): (1, "slice indices; LinearLayout moves them to the weight's device"),
    ("ds_ext/pmm/tuning.py", "frombuffer"): (1, "host JSON of timings; PMMEngine.all_gather_world moves it"),
    ("ds_ext/pmm/tuning.py", "tensor"): (1, "host JSON of timings; PMMEngine.all_gather_world moves it"),
    ("ds_ext/pmm/tuning.py", "zeros"): (1, "host JSON of timings; PMMEngine.all_gather_world moves it"),
    ("ds_ext/zero_topo/checkpoint.py", "empty"): (1, "reads a checkpoint file on the host"),
    ("ds_ext/zero_topo/checkpoint_io.py", "zeros"): (1, "host staging of loaded weights, copied into the unit"),
    ("ds_ext/zero_topo/tiers.py", "frombuffer"): (1, "checkpoint file bytes sent over the tiers' own gloo group"),
}


def _deviceless_calls() -> Counter:
    found: Counter = Counter()
    for path in sorted((ROOT / "ds_ext").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(HOST_PACKAGES):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in FACTORIES
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "torch"
                and not any(k.arg == "device" for k in node.keywords)
            ):
                found[(rel, node.func.attr)] += 1
    return found


def test_every_tensor_the_library_creates_names_its_device():
    found = _deviceless_calls()
    allowed = Counter({key: n for key, (n, _) in HOST_SIDE.items()})
    unexpected = found - allowed
    assert not unexpected, (
        "torch factory calls without device= (a collective on NCCL refuses host tensors): "
        + ", ".join(f"{f}: torch.{fn} x{n}" for (f, fn), n in sorted(unexpected.items()))
    )
    assert found == allowed, f"stale HOST_SIDE entries: {dict(allowed - found)}"


def test_loaded_optimizer_state_is_placed_as_torch_places_it():
    """A ZeRO-topo checkpoint's optimizer state lands on its master's device (it stayed on the
    host, and the first CUDA step after ``load_checkpoint`` failed); Adam's ``step`` stays on
    the host unless the optimizer is fused or capturable. The meta device stands in for a GPU."""
    import torch

    from ds_ext.zero_topo.optimizer import _state_value

    master = torch.empty(4, device="meta")
    state = {"exp_avg": torch.zeros(4, dtype=torch.float64), "step": torch.tensor(3.0)}
    placed = {k: _state_value(master, k, v, {"fused": None}) for k, v in state.items()}
    assert placed["exp_avg"].device.type == "meta" and placed["exp_avg"].dtype == torch.float32
    assert placed["step"].device.type == "cpu"
    assert _state_value(master, "step", state["step"], {"fused": True}).device.type == "meta"
    assert _state_value(master, "step", 5, {}) == 5
