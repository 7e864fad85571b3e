"""No full model per rank: build on the meta device, materialise the shards.

Converting a model needs no collective, so 2 gloo ranks play the 8 ranks of each grid (rank
r takes the coordinates of grid ranks r, r + 2, r + 4, r + 6):

* the shards materialised from a ``build_on_meta`` model equal slicing the serial CPU
  initialisation under the same seed, bit for bit (ds_ext's GPT, Llama and GPT-NeoX with
  and without tied embeddings; grids (2,2,2,1) and (1,2,4,1)), ties kept, the generator left
  where the serial build leaves it (through ``ds_ext.initialize`` on 8 ranks the meta-built
  GPT and tied Llama train like the serial model: tests/test_pmm_parity.py);
* from a full checkpoint on disk (``torch.save``'d GPT state dict, Hugging Face
  ``save_pretrained`` safetensors of Llama and GPT-NeoX) the shards equal slicing the full
  model loaded independently (``torch.load`` / ``from_pretrained``);
* peak resident memory per rank (VmHWM, reset before the build) stays near the rank's shards
  for a 201 MB GPT, from the recorded init and from a safetensors checkpoint, where building
  the serial model first (the old path) exceeds the bound.

Without processes: what cannot be built on meta or replayed fails in one line naming it.
"""

import pytest
from pmm_helpers import MODELS

WORLD_SIZE = 2
GRID_SIZE = 8
GRIDS = [(2, 2, 2, 1), (1, 2, 4, 1)]
MiB = 2**20


def _grid_ranks():
    """The ranks of an 8-rank grid this rank plays."""
    import torch.distributed as dist

    return range(dist.get_rank(), GRID_SIZE, WORLD_SIZE)


def _engine(grid, rank):
    """An engine with grid rank ``rank``'s coordinates: conversion needs no collective."""
    from ds_ext.parallel import Grid
    from ds_ext.pmm.engine import PMMEngine
    from ds_ext.pmm.grid import Axis

    coords = Grid(*grid).coords(rank)
    return PMMEngine({n: Axis(n, None, s, coords[n]) for n, s in zip(("x", "y", "z", "data"), grid)}, comm=None)


def _tied(model):
    head = getattr(model, "lm_head", None)
    if head is None:
        return None
    return head.weight is model.get_input_embeddings().weight


def _shards_vs_serial(cases):
    """Per (family, grid) and grid rank: (names differ, parameters not bit-identical, ties (meta, serial),
    generator equal)."""
    import torch

    from ds_ext.pmm import build_on_meta, local_shards, parallelize

    out = []
    for family, grid in cases:
        for rank in _grid_ranks():
            serial = MODELS[family]()
            after_serial = torch.get_rng_state()
            full = {n: p.detach() for n, p in serial.named_parameters()}
            parallelize(serial, _engine(grid, rank))
            want = local_shards(serial, full)
            model = build_on_meta(MODELS[family])
            same_rng = torch.equal(torch.get_rng_state(), after_serial)
            assert all(p.is_meta for p in model.parameters())
            parallelize(model, _engine(grid, rank))
            got = dict(model.named_parameters())
            buffers = dict(serial.named_buffers())
            out.append(
                {
                    "case": (family, grid, rank),
                    "names": sorted(set(got) ^ set(want)),
                    "differ": [n for n in want if n in got and not torch.equal(got[n], want[n])]
                    + [n for n, b in model.named_buffers() if not torch.equal(b, buffers[n])],
                    "tied": (_tied(model), _tied(serial)),
                    "rng": same_rng,
                }
            )
    return out


CASES = [(f, g) for f in ("gpt", "llama_tied") for g in GRIDS] + [
    ("llama", GRIDS[0]),
    ("neox", GRIDS[1]),
    ("neox_tied", GRIDS[0]),
]


def test_meta_shards_equal_slicing_the_serial_init(world):
    for results in world.run(_shards_vs_serial, CASES):
        assert len(results) == GRID_SIZE // WORLD_SIZE * len(CASES)
        for r in results:
            family = r["case"][0]
            assert r["names"] == [] and r["differ"] == [], r
            assert r["rng"] and r["tied"][0] == r["tied"][1], r
            assert r["tied"][0] is (None if family == "gpt" else family.endswith("tied")), r


def _checkpoint_shards(tmp):
    """Per family: (parameters not bit-identical to slicing the independently loaded full model,
    any equal to the seed's init, i.e. not read from the file)."""
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from ds_ext.pmm import build_on_meta, local_shards, parallelize

    paths = {"gpt": f"{tmp}/gpt.pt", "llama_tied": f"{tmp}/llama_tied", "neox": f"{tmp}/neox"}
    if dist.get_rank() == 0:
        for family, path in paths.items():
            model = MODELS[family]()
            with torch.no_grad():  # values no initialisation gives
                for p in model.parameters():
                    p.add_(torch.rand_like(p))
            torch.save(model.state_dict(), path) if family == "gpt" else model.save_pretrained(path)
    dist.barrier()
    out = {}
    for family, path in paths.items():
        loaded = (
            torch.load(path, weights_only=True)
            if family == "gpt"
            else dict(AutoModelForCausalLM.from_pretrained(path).named_parameters())
        )
        for rank in _grid_ranks():
            init = MODELS[family]()
            parallelize(init, _engine((2, 2, 2, 1), rank))
            model = build_on_meta(MODELS[family], checkpoint=path)
            parallelize(model, _engine((2, 2, 2, 1), rank))
            want, seed = local_shards(model, loaded), dict(init.named_parameters())
            got = dict(model.named_parameters())
            assert set(got) == set(want), family
            out[family, rank] = (
                [n for n in got if not torch.equal(got[n], want[n])],
                [n for n in got if got[n].numel() > 1 and torch.equal(got[n], seed[n])],
                _tied(model),
            )
    return out


def test_checkpoint_loads_shard_by_shard(world, tmp_path):
    for result in world.run(_checkpoint_shards, str(tmp_path)):
        assert len(result) == 3 * GRID_SIZE // WORLD_SIZE
        for (family, _), (differ, from_init, tied) in result.items():
            assert differ == [] and from_init == [], (family, differ, from_init)
            assert tied is (None if family == "gpt" else family == "llama_tied"), family


# ---- peak host memory per rank ------------------------------------------------------------
BIG = {"vocab_size": 256, "seq_len": 128, "d_model": 512, "n_layers": 16, "n_heads": 8}  # 50.6 M parameters
SLACK = 16 * MiB  # allocator and interpreter noise (measured: shard + 8.6 MiB)


def _status(key):
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith(key + ":"))


def _peak_growth(build):
    """(peak resident growth while building and converting, bytes of the rank's parameters, of the largest
    serial parameter, of the serial model)."""
    import ctypes
    import gc

    import torch

    from ds_ext.models import GPT, GPTConfig
    from ds_ext.pmm import parallelize

    cfg = GPTConfig(**BIG)
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")  # VmHWM := VmRSS
    base = _status("VmRSS")
    torch.manual_seed(0)
    model = build(lambda: GPT(cfg))
    sizes = [p.numel() * 4 for p in model.parameters()]
    parallelize(model, _engine((2, 2, 2, 1), _grid_ranks()[0]))
    peak = _status("VmHWM") - base
    return peak, sum(p.numel() * p.element_size() for p in model.parameters()), max(sizes), sum(sizes)


def _memory(tmp):
    """Peaks (see _peak_growth) built from the recorded init and from a safetensors checkpoint, and on
    rank 0 the old path (the serial model built first)."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    from ds_ext.models import GPT, GPTConfig
    from ds_ext.pmm import build_on_meta, parallelize

    parallelize(build_on_meta(MODELS["gpt"]), _engine((2, 2, 2, 1), 0))  # one-time lazy set-up (~75 MiB)
    meta = _peak_growth(build_on_meta)
    serial_first = None
    if dist.get_rank() == 0:
        serial_first = _peak_growth(lambda factory: factory())
        save_file(GPT(GPTConfig(**BIG)).state_dict(), f"{tmp}/big.safetensors")
    dist.barrier()
    stored = _peak_growth(lambda factory: build_on_meta(factory, checkpoint=f"{tmp}/big.safetensors"))
    return meta, stored, serial_first


def _bound(shard, largest):
    """The rank's shards, one serial parameter being sliced plus its out block, and noise."""
    return shard + 2 * largest + SLACK


def test_peak_memory_per_rank_stays_near_its_shard(world, tmp_path):
    results = world.run(_memory, str(tmp_path))
    for rank, result in enumerate(results):
        for how, (peak, shard, largest, serial) in zip(("init", "safetensors"), result):
            assert serial > 200e6 and shard < serial / 7, (shard, serial)  # (2,2,2,1): layers / 8, norms / 2
            assert peak <= _bound(shard, largest), (
                f"rank {rank}, {how}: peak {peak / MiB:.1f} MiB > "
                f"{_bound(shard, largest) / MiB:.1f} MiB (shard {shard / MiB:.1f})"
            )
    (_, shard, largest, serial), _, (old_peak, *_) = results[0]
    assert old_peak > serial > _bound(shard, largest), (old_peak, serial)  # the bound catches a full build


# ---- no processes: one line for what cannot be built on meta or replayed --------------------
def test_unsupported_on_meta_fails_in_one_line(tmp_path):
    import torch
    from torch import nn

    from ds_ext.pmm import MetaBuildError, build_on_meta, materialize, parallelize
    from ds_ext.pmm.checkpoint import CheckpointError
    from ds_ext.pmm.engine import PMMEngine
    from ds_ext.pmm.grid import Axis
    from ds_ext.pmm.parallelize import ConversionError

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.arange(4.0) * 2)  # computed from another tensor

    class Truncated(nn.Linear):
        def reset_parameters(self):
            nn.init.trunc_normal_(self.weight)  # on meta, torch returns at once

    with pytest.raises(
        MetaBuildError,
        match=r"^ds_ext.pmm.build_on_meta: the initial value of w cannot be "
        r"replayed: it is computed by aten.mul.Tensor from other tensors$",
    ):
        materialize(build_on_meta(Scaled))
    with pytest.raises(
        MetaBuildError,
        match=r"^ds_ext.pmm.build_on_meta: torch.nn.init.trunc_normal_ skips meta "
        r"tensors, so its values .* cannot be recorded; build the model normally",
    ):
        build_on_meta(lambda: Truncated(4, 4))
    gpt = MODELS["gpt"]
    state = gpt().state_dict()
    torch.save({k: v for k, v in state.items() if k != "pos.weight"}, tmp_path / "missing.pt")
    torch.save({**state, "head.weight": state["embed.weight"]}, tmp_path / "extra.pt")
    with pytest.raises(CheckpointError, match=r"missing.pt lacks 1 parameter\(s\) of the model: \['pos.weight'\]$"):
        build_on_meta(gpt, checkpoint=tmp_path / "missing.pt")
    with pytest.raises(CheckpointError, match=r"extra.pt holds 1 tensor\(s\) the model lacks: \['head.weight'\]$"):
        build_on_meta(gpt, checkpoint=tmp_path / "extra.pt")
    with torch.device("meta"):
        plain = gpt()
    engine = PMMEngine({n: Axis(n, None, 1, 0) for n in ("x", "y", "z", "data")}, comm=None)
    with pytest.raises(
        ConversionError,
        match=r"^ds_ext.pmm.parallelize: parameter embed.weight is on the meta "
        r"device with no recorded initialisation .*build_on_meta",
    ):
        parallelize(plain, engine)

    def with_conv():
        model = gpt()
        model.blocks[0].extra = nn.Conv1d(2, 2, 1)  # a module type no rule converts
        return model

    model = build_on_meta(with_conv)
    assert model.blocks[0].extra.weight.is_meta
    with pytest.raises(ConversionError, match=r"^ds_ext.pmm.parallelize: cannot convert blocks.0.extra \(Conv1d\)"):
        parallelize(model, engine)
