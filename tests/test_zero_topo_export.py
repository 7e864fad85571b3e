"""ZeRO-topo checkpoints exported to the tools users leave for (item 3):
``ds-ext checkpoint export --format safetensors | dcp``.

4 gloo ranks (2 nodes x 1 GPU x 2 GCDs) train a tiny Hugging Face model under ZeRO-topo and
save. References, none sharing code with the export: transformers' own ``from_pretrained`` and
forward (the exported directory's logits equal the running model's, bit for bit, in fp32 and in
bf16); torch's FSDP2 and ``dcp.load`` in a world of 2 ranks (every parameter equals
``consolidate``'s); the anonymous memory of the exporting process, sampled from /proc (the
safetensors export holds about one output file, far below the model).
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from ds_ext.local_world import World

WORLD_SIZE = 4
TOPOLOGY = {"preset": "frontier", "sizes": {"gpu": 1}, "emulate": True}
SEQ = 16
# GPT-NeoX of 7.3M parameters (29 MB in fp32) in files of 4 MB; a Llama with tied embeddings
MODELS = {
    "gpt-neox": {"layers": 4, "hidden": 384, "heads": 8, "tied": False},
    "llama": {"layers": 2, "hidden": 64, "heads": 4, "tied": True},
}
SHARD_MB = 4


@pytest.fixture(scope="module")
def neox(world, tmp_path_factory):
    """The GPT-NeoX's checkpoint (its tag directory) and the running model's logits."""
    from ds_ext.zero_topo.checkpoint import resolve_tag_dir

    save_dir = tmp_path_factory.mktemp("neox")
    logits, _ = world.run(_train_and_save, "gpt-neox", str(save_dir), False)[0]
    return resolve_tag_dir(save_dir, None), logits


@pytest.fixture(scope="module")
def world2():
    w = World(2)
    yield w
    w.close()


def _model(kind: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    from ds_ext.models.hf import tiny_causal_lm

    m = MODELS[kind]
    if kind == "gpt-neox":
        return tiny_causal_lm(kind, layers=m["layers"], hidden=m["hidden"], heads=m["heads"], seq=SEQ)
    cfg = LlamaConfig(  # tiny_causal_lm's Llama, its embeddings tied
        vocab_size=256,
        hidden_size=m["hidden"],
        intermediate_size=2 * m["hidden"],
        num_hidden_layers=m["layers"],
        num_attention_heads=m["heads"],
        num_key_value_heads=m["heads"] // 2,
        max_position_embeddings=SEQ,
        tie_word_embeddings=m["tied"],
    )
    return LlamaForCausalLM(cfg)


def _batch(seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(seed))


def _train_and_save(kind: str, tmp: str, bf16: bool):
    """Two AdamW steps of ``kind`` under ZeRO-topo, a save, then the running model's logits on a
    fixed batch and its (gathered) parameters."""
    import torch.distributed as dist

    import ds_ext

    torch.manual_seed(0)
    model = _model(kind)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 0},
        "steps_per_print": 10**9,
        "ds_ext": {"topology": TOPOLOGY, "zero_topo": {"enabled": True, "preset": "zero_topo"}},
    }
    if bf16:
        cfg["bf16"] = {"enabled": True}
    engine, *_ = ds_ext.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), config=cfg)
    for step in range(2):
        x = _batch(100 * step + dist.get_rank())
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
    engine.save_checkpoint(tmp)
    engine.module.eval()
    with engine.ds_ext.gathered_parameters(), torch.no_grad():
        logits = engine.module(input_ids=_batch(7)).logits
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    dist.barrier()
    return logits, params


# the exporting process, alone: its anonymous memory (RssAnon) sampled every millisecond around the
# export; glibc told to map every large block on its own, so that a freed one leaves the process
PROBE = """
import sys, threading, time
from pathlib import Path
import safetensors.torch
from ds_ext.zero_topo.export import export_safetensors

def anon():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))

base = peak = anon()
done = False
def sample():
    global peak
    while not done:
        peak = max(peak, anon())
        time.sleep(0.001)
thread = threading.Thread(target=sample, daemon=True)
thread.start()
try:
    out = export_safetensors(Path(sys.argv[1]), Path(sys.argv[2]), int(float(sys.argv[3]) * 2**20))
finally:
    done = True
    thread.join()
print(peak - base, out.total_bytes, max(p.stat().st_size for p in out.files))
"""


def test_safetensors_export_streams_and_loads_in_transformers_with_the_running_models_logits(neox, tmp_path):
    from transformers import AutoModelForCausalLM

    tag_dir, running = neox
    out = tmp_path / "hf"
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "PYTHONWARNINGS": "ignore"}
    probe = subprocess.run(
        [sys.executable, "-c", PROBE, str(tag_dir), str(out), str(SHARD_MB)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert probe.returncode == 0, probe.stderr[-3000:]
    peak, total, largest = (int(v) for v in probe.stdout.split())
    assert total > 29e6 and largest <= SHARD_MB * 2**20 + 2**16  # the tensors, and its JSON header
    # what it held: about one output file (1.5x, the bound), not the 29 MB model
    assert peak <= 1.5 * SHARD_MB * 2**20, (peak, largest, total)

    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) == len(set(index["weight_map"].values())) >= 7  # 29 MB in files of 4 MB
    assert files[-1] == f"model-{len(files):05d}-of-{len(files):05d}.safetensors"
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(loaded).__name__ == "GPTNeoXForCausalLM"
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=_batch(7)).logits, running)


def test_bf16_export_of_a_tied_llama_keeps_its_bf16_weights_and_names_the_tie(world, tmp_path):
    """bf16 training, ``--dtype bf16``: the masters rounded as the running weights are, so the
    model ``from_pretrained`` loads in bf16 holds the running model's bf16 weights exactly (its
    logits differ: DeepSpeed's bf16 cast also rounds the rotary embedding's buffer, which
    transformers keeps in fp32); the tied head is written once, under the embedding's name, as
    ``save_pretrained`` does, and tied again on load."""
    from transformers import AutoModelForCausalLM

    from ds_ext.cli import main

    _, running = world.run(_train_and_save, "llama", str(tmp_path / "ckpt"), True)[0]
    argv = ["checkpoint", "export", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--format", "safetensors"]
    assert main([*argv, "--dtype", "bf16"]) == 0
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["tied"] == {"lm_head.weight": "model.embed_tokens.weight"}
    assert "lm_head.weight" not in index["weight_map"]
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.bfloat16)
    state = dict(loaded.named_parameters(remove_duplicate=False))
    assert set(state) == set(running) | {"lm_head.weight"}
    for name, value in running.items():
        assert value.dtype == torch.bfloat16 and torch.equal(state[name], value), name
    assert state["lm_head.weight"] is state["model.embed_tokens.weight"]
    # imported back: the tied head is the embedding again
    from ds_ext.zero_topo.export import import_safetensors

    back = import_safetensors(tmp_path / "hf")
    assert back["lm_head.weight"] is back["model.embed_tokens.weight"]
    assert set(back) == set(running) | {"lm_head.weight"}
    # an export never writes into a directory that holds anything
    assert main(["checkpoint", "export", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--format", "dcp"]) == 2


def _fsdp2_load(dcp_dir: str, config: dict) -> dict | None:
    """The model built from ``config`` with another random init, sharded by FSDP2 over this
    world (every layer and the root), loaded by ``dcp.load``; its full state dict (rank 0)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(99 + dist.get_rank())
    model = GPTNeoXForCausalLM(GPTNeoXConfig.from_dict(config))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.gpt_neox.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    state = get_model_state_dict(model)
    assert all(type(v).__name__ == "DTensor" for v in state.values())  # sharded, not whole
    dcp.load(state, checkpoint_id=dcp_dir)
    set_model_state_dict(model, state)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.clone() for k, v in full.items()} if dist.get_rank() == 0 else None


def test_dcp_export_loads_into_fsdp2_at_another_world_size(neox, world2, tmp_path):
    from ds_ext.zero_topo.checkpoint import consolidate
    from ds_ext.zero_topo.export import export_dcp

    tag_dir, _ = neox
    export_dcp(tag_dir, tmp_path / "dcp")
    full = world2.run(_fsdp2_load, str(tmp_path / "dcp"), _model("gpt-neox").config.to_dict())[0]
    reference = consolidate(tag_dir)
    assert set(full) == set(reference)
    for name, value in reference.items():
        assert torch.equal(full[name], value), name


def test_import_reads_both_exports_back_into_consolidates_state_dict(neox, tmp_path):
    """``ds-ext checkpoint import``: each export read back into one state dict equal to
    ``consolidate``'s, which the model's own ``load_state_dict`` takes strictly; a directory that
    is not an export is refused in one line."""
    from ds_ext.cli import main
    from ds_ext.zero_topo.checkpoint import consolidate

    tag_dir, _ = neox
    reference = consolidate(tag_dir)
    for fmt in ("safetensors", "dcp"):
        out = tmp_path / fmt
        assert main(["checkpoint", "export", str(tag_dir), str(out), "--format", fmt, "--max-shard-MB", "4"]) == 0
        assert main(["checkpoint", "import", str(out), str(tmp_path / f"{fmt}.pt"), "--format", fmt]) == 0
        state = torch.load(tmp_path / f"{fmt}.pt", weights_only=True)
        assert set(state) == set(reference), fmt
        for name, value in reference.items():
            assert torch.equal(state[name], value), (fmt, name)
        _model("gpt-neox").load_state_dict(state, strict=True)
    assert main(["checkpoint", "import", str(tmp_path / "dcp"), str(tmp_path / "x.pt"), "--format", "safetensors"]) == 2
    assert main(["checkpoint", "import", str(tmp_path / "safetensors"), str(tmp_path / "x.pt"), "--format", "dcp"]) == 2
