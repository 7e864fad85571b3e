"""ZeRO-topo on several processes sharing one GPU (``pytest -m gpu``; skipped without CUDA).

NCCL refuses two ranks of one communicator on the same device ("Duplicate GPU detected"), so
the processes talk over gloo, which takes CUDA tensors for the collectives ZeRO-topo issues.
Reference: plain DeepSpeed data parallelism on the same processes, model, data and seed.
"""

import os

import pytest

pytestmark = pytest.mark.gpu

WORLD_SIZE = 2
WORLD_BACKEND = (os.environ.get("DS_EXT_SHARED_GPU_BACKEND", "gloo"), "cuda")
TOPOLOGY = {"preset": "frontier", "sizes": {"gpu": 1, "gcd": 2}}  # one node, one GPU, two GCD ranks


def test_zero_topo_on_processes_sharing_the_gpu(world, tmp_path):
    from test_gpu import zero_topo_run

    for r in world.run(zero_topo_run, str(tmp_path), TOPOLOGY):
        assert r["device"].startswith("cuda"), r["device"]
        assert len(r["ref"]) == len(r["ours"])
        for a, b in zip(r["ref"], r["ours"]):
            assert abs(a - b) <= 1e-5 * abs(a), (r["ref"], r["ours"])
        assert r["unmoved"] == [] and r["default"][-1] < r["default"][0], r
