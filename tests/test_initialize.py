"""ds_ext.initialize against plain deepspeed.initialize on 4 gloo ranks.

With no plugin enabled, ds_ext must not change a single bit of training; bad input must
fail before any collective, in one line, on every rank.
"""

import pytest

WORLD_SIZE = 4
_CORPUS = []


def _corpus():
    from ds_ext.data import ByteCorpus

    if not _CORPUS:
        _CORPUS.append(ByteCorpus(max_bytes=300_000))
    return _CORPUS[0]


def _ds_config(stage: int, bf16: bool) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": bf16},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "steps_per_print": 10_000,
    }


def _train(use_ds_ext: bool, stage: int, bf16: bool, steps: int = 10):
    import deepspeed
    import torch
    import torch.distributed as dist

    import ds_ext
    from ds_ext.integration import ds_engine
    from ds_ext.models import GPT, GPTConfig

    torch.manual_seed(1234)
    cfg = GPTConfig(seq_len=32, d_model=64, n_layers=2, n_heads=4)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ds_cfg = _ds_config(stage, bf16)
    if use_ds_ext:
        ds_cfg["ds_ext"] = {}
        result = ds_ext.initialize(model=model, optimizer=opt, config=ds_cfg)
        engine, wrapped, loader, scheduler = result  # DeepSpeed's order, and by name:
        assert (result.engine, result.optimizer, result.training_dataloader, result.lr_scheduler) == (
            engine,
            engine.optimizer,
            None,
            None,
        ) and wrapped is engine.optimizer
    else:
        ds_engine.disable_jit_builds()
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_cfg)
    rank, dp = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(steps):
        for micro in range(2):
            tokens = _corpus().micro_batch(step, micro, rank, dp, 2, 2, cfg.seq_len)
            loss = engine(tokens)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    ledger_steps = len(engine.ds_ext.ledger.steps) if use_ds_ext else None
    traffic = engine.ds_ext.ledger.mean_by_level() if use_ds_ext else None
    engine.destroy()
    return losses, ledger_steps, traffic


@pytest.mark.parametrize("stage, bf16", [(0, False), (2, False), (3, True)])
def test_empty_block_is_bit_identical_to_deepspeed(world, stage, bf16):
    plain = world.run(_train, False, stage, bf16)
    ours = world.run(_train, True, stage, bf16)
    for (lp, _, _), (lo, nsteps, traffic) in zip(plain, ours):
        assert lo == lp  # bit for bit, every micro-step, every rank
        assert nsteps == 10  # one ledger step per optimizer step
        # DeepSpeed's own collectives were counted (all ranks on one emulated node)
        assert traffic["local"] > 0 and traffic["node"] == 0
    assert plain[0][0][-1] < plain[0][0][0]  # it trains


def _initialize_error(block):
    from init_support import initialize_error

    from ds_ext.models import GPT, GPTConfig

    model = GPT(GPTConfig(seq_len=16, d_model=32, n_layers=1, n_heads=2))
    return initialize_error(model, {**_ds_config(0, False), "ds_ext": block})


@pytest.mark.parametrize(
    "block, kind, message",
    [
        (
            {"topology": {"preset": "frontier", "emulat": True}},
            "DsExtConfigError",
            "ds_ext.topology.emulat: unknown key; allowed keys: emulate, levels, preset, sizes",
        ),
        (
            {"topology": {"preset": "titan"}},
            "DsExtConfigError",
            "ds_ext.topology.preset: Input should be 'frontier' or 'dgx-a100' (got 'titan')",
        ),
        (
            {"topology": {"preset": "frontier", "emulate": True}},
            "TopologyError",
            "world size 4 does not fit topology 'frontier' (2 gcd x 4 gpu = 8 ranks per node): "
            "it must be a multiple of 8",
        ),
        (
            {"topology": {"preset": "frontier", "sizes": {"gpu": 1}}},
            "TopologyError",
            "the job runs 4 ranks per node (launcher variables) but topology 'frontier' needs 2",
        ),
        ("frontier", "DsExtConfigError", "ds_ext: must be a JSON object, got str"),
    ],
)
def test_bad_input_fails_before_training(world, block, kind, message):
    results = world.run(_initialize_error, block, timeout=120)
    for res in results:
        assert res is not None
        got_kind, got_message = res
        assert got_kind == kind and message in got_message and "\n" not in got_message


def _start_up_messages():
    """ds_ext.initialize with ZeRO-topo on a model without nn.ModuleList: the printed lines and
    the Python warnings that mention ds_ext, on this rank."""
    import contextlib
    import io
    import warnings

    import torch

    import ds_ext

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    cfg = {
        **_ds_config(0, True),
        "ds_ext": {
            "topology": {"preset": "frontier", "sizes": {"gpu": 1}, "emulate": True},
            "zero_topo": {"enabled": True},
        },
    }
    out = io.StringIO()
    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(out):
        warnings.simplefilter("default")
        engine, *_ = ds_ext.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=cfg)
    engine.destroy()
    printed = out.getvalue()
    return printed[printed.find("[Rank 0] ds_ext") :] if "ds_ext" in printed else "", [
        str(w.message) for w in caught if "ds_ext" in str(w.message)
    ]


def test_start_up_banner_and_warnings_once_on_rank_0(world):
    (banner, warned), *others = world.run(_start_up_messages)
    assert all(text == "" and warnings == [] for text, warnings in others)
    assert len(warned) == 1 and "no nn.ModuleList" in warned[0]
    assert banner.startswith("[Rank 0] ds_ext 0.1.0: frontier: world 4") and banner.count("ds_ext 0.1.0") == 1
    assert "\n  zero_topo: weights gcd" in banner and "\ncomm: ledger on" in banner
    assert "\ngroups of rank 0: gcd [0, 1]; gpu [0, 1]; node [0, 1, 2, 3]" in banner


class _DataParallelMpu:
    """A Megatron-style mpu (the names DeepSpeed reads) of pure data parallelism over the world."""

    def __init__(self):
        import torch.distributed as dist

        self.dist = dist
        self.model_group = dist.new_group([dist.get_rank()])  # collective: every rank makes its own

    def get_model_parallel_rank(self):
        return 0

    def get_model_parallel_world_size(self):
        return 1

    def get_model_parallel_group(self):
        return self.model_group

    def get_data_parallel_rank(self):
        return self.dist.get_rank()

    def get_data_parallel_world_size(self):
        return self.dist.get_world_size()

    def get_data_parallel_group(self):
        return self.dist.group.WORLD


def _mpu_release_after_a_late_destroy():
    """Engine A and then B with the same mpu object; A's ``destroy()`` runs again after B exists,
    as DeepSpeed's ``__del__`` runs it when the collector frees A (at a moment that differs between
    ranks). Returns ``groups.mpu is mpu`` after each event."""
    import torch
    from deepspeed.utils import groups

    import ds_ext
    from ds_ext.models import GPT, GPTConfig

    mpu = _DataParallelMpu()

    def engine():
        model = GPT(GPTConfig(seq_len=16, d_model=32, n_layers=1, n_heads=2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        config = {**_ds_config(0, False), "ds_ext": {}}
        return ds_ext.initialize(model=model, optimizer=opt, config=config, mpu=mpu).engine

    seen = []
    a = engine()
    seen.append(groups.mpu is mpu)
    a.destroy()
    seen.append(groups.mpu is mpu)
    b = engine()
    a.destroy()  # the collector's late call: B keeps its mpu
    seen.append(groups.mpu is mpu)
    b.destroy()
    seen.append(groups.mpu is mpu)
    return seen


def test_a_late_destroy_of_an_earlier_engine_leaves_the_live_engines_mpu(world):
    """Released on an engine's destroy, DeepSpeed's global ``groups.mpu`` is not released by an
    earlier engine's destroy after a later engine set the same mpu (that had one rank's GPT-NeoX
    run take another data-parallel group than the others, and hang)."""
    assert world.run(_mpu_release_after_a_late_destroy) == [[True, False, True, False]] * WORLD_SIZE


def _step_clock(every: int) -> tuple[int, str, str]:
    """examples/step_clock_plugin.py, imported as a user imports their plugin, enabled from the
    block: the optimizer steps it timed, the banner's plugin lines, and the refusal of an unknown
    key in its section."""
    import sys
    from pathlib import Path

    import torch

    import ds_ext
    from ds_ext.errors import DsExtConfigError
    from ds_ext.models import GPT, GPTConfig
    from ds_ext.plugin import unregister_plugin

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import step_clock_plugin  # noqa: F401  (registers "step_clock")

    try:
        model = GPT(GPTConfig(seq_len=16, d_model=32, n_layers=1, n_heads=2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        config = {**_ds_config(0, False), "ds_ext": {"step_clock": {"enabled": True, "every": every}}}
        engine = ds_ext.initialize(model=model, optimizer=opt, config=config).engine
        rank, dp = torch.distributed.get_rank(), torch.distributed.get_world_size()
        for step in range(3):  # 3 optimizer steps of 2 micro-batches
            for micro in range(2):
                engine.backward(engine(_corpus().micro_batch(step, micro, rank, dp, 2, 2, 16)))
                engine.step()
        timed, banner = len(engine.ds_ext.plugin("step_clock").seconds), engine.ds_ext.banner()
        engine.destroy()
        try:
            ds_ext.initialize(model=model, optimizer=opt, config={**config, "ds_ext": {"step_clock": {"evry": 1}}})
        except DsExtConfigError as err:
            refused = str(err)
    finally:
        unregister_plugin("step_clock")
    return timed, banner[banner.index("plugins:") :], refused


def test_a_plugin_from_outside_the_library(world):
    """docs/adding-a-plugin.md's example: registered from its own module, its section validated with
    the built-ins', its hooks run in the engine (one timing per optimizer step, not per micro-batch)."""
    timed, plugins, refused = world.run(_step_clock, 2)[0]
    assert timed == 3
    assert plugins.startswith("plugins:\n  step_clock: each optimizer step timed, the mean of every 2 logged")
    assert refused == "ds_ext.step_clock.evry: unknown key; allowed keys: enabled, every"
