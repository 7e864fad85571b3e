"""ZeRO-topo over the data axis of 3D-PMM (000 §V-B) on 8 gloo ranks as Frontier in
miniature (2 nodes x 2 MI250X x 2 GCDs), grid (2, 1, 2, 2): the data axis pairs the two nodes.

The reference is 3D-PMM with DeepSpeed's own ZeRO-1 under 3D-PMM's mpu, in the same dtype (shares no
code with ZeRO-topo). A world of its own: beside the Megatron client's tests
(tests/test_zero_topo_layouts.py), whose world keeps its process groups, these steps took twice
as long.
"""

import pytest
from test_zero_topo_layouts import STEPS, UNQUANTIZED, _params

WORLD_SIZE = 8

PMM_GRID = (2, 1, 2, 2)  # x, y, z, data: the data axis pairs the two nodes
SEQ_PMM = 16  # tests/pmm_helpers.py's SEQ


def _masters(engine):
    """{parameter name: the fp32 master pieces this rank's ZeRO-topo optimizer holds of it}."""
    import torch

    opt, out = engine.ds_ext.plugin("zero_topo").optimizer, {}
    for unit, lo, hi, master in opt.segments:
        start = opt.own_range(unit)[0] + lo
        i = max(k for k, off in enumerate(unit.offsets) if off <= start)
        name = unit.param_names[i][0]
        out[name] = torch.cat([out[name], master]) if name in out else master.clone()
    return out


def _pmm(zero_topo, bf16=False):
    """Losses (mean over the data axis), global norms and this rank's 3D-PMM shards after ``STEPS``
    SGD steps of the ds_ext GPT on grid ``PMM_GRID`` in fp32 or ``bf16``, with ``zero_topo`` over the
    data axis or (None) DeepSpeed's ZeRO-1 under 3D-PMM's mpu; with ZeRO-topo also its ledger and
    model."""
    import torch
    import torch.distributed as dist
    from pmm_helpers import _data_mean, _rows, ds_config, gpt, tokens

    import ds_ext

    cfg = ds_config(PMM_GRID, clip=0.05, stage=0 if zero_topo else 1, bf16=bf16)
    cfg["zero_allow_untested_optimizer"] = True
    if zero_topo:
        cfg["ds_ext"] |= {"comm": {"count_torch_collectives": False}, "zero_topo": {"enabled": True, **zero_topo}}
    engine, *_ = ds_ext.initialize(
        model=gpt(), optimizer=lambda p: torch.optim.SGD(p, lr=0.5, momentum=0.9), config=cfg
    )
    axes = engine.ds_ext.plugin("pmm3d").axes
    rows, _ = _rows(engine)
    init = _params(engine)
    masters = _masters(engine) if zero_topo else {}
    losses, norms = [], []
    for step in range(STEPS):
        loss = engine(tokens(step)[rows])
        engine.backward(loss)
        engine.step()
        losses.append(_data_mean(loss.detach().float(), axes["data"]))
        norms.append(float(engine.get_global_grad_norm()))
    params = _params(engine)
    out = {
        "losses": losses,
        "norms": norms,
        "params": params,
        "still": [n for n, p in params.items() if torch.equal(p, init[n])],
    }
    if zero_topo:
        # bf16 weights can stay put where an update is below half a bf16 ulp (LayerNorm gains at 1.0
        # under clipped SGD): the fp32 masters must move; names of the parameters this rank's moved
        out["masters_moved"] = sorted({n for n, m in _masters(engine).items() if not torch.equal(m, masters[n])})
        out["masters_held"] = sorted(masters)
        from ds_ext.perf.pmm import ledger_bytes
        from ds_ext.pmm.plans import plan_for
        from ds_ext.pmm.spec import model_spec

        plugin, serial = engine.ds_ext.plugin("zero_topo"), gpt()
        # 3D-PMM's own collectives (001 Eqs 5.1-5.5) and ZeRO-topo's (003) in one ledger
        model = ledger_bytes(
            model_spec(serial, plan_for(serial)),
            engine.ds_ext.plugin("pmm3d").grid,
            engine.ds_ext.topology,
            rows.stop - rows.start,
            SEQ_PMM,
            2 if bf16 else 4,
            by_layer=False,
            data_reduction=False,
        )
        for phase, levels in plugin.analytic_traffic(1).bytes.items():
            for level, nbytes in levels.items():
                model.setdefault(phase, {})[level] = model.get(phase, {}).get(level, 0) + nbytes
        out |= {
            "describe": plugin.describe(),
            "analytic": model,
            "measured": {ph: dict(v) for ph, v in engine.ds_ext.ledger.steps[-1].by_phase().items()},
        }
    engine.destroy()
    dist.barrier()
    return out


# bf16 against DeepSpeed ZeRO-1 bf16 under the same grid: both keep fp32 masters, but reduce the bf16
# gradients over the data axis in different orders, so gradients differ by a few bf16 roundings
# (2^-8 relative) and the weights, rounded back to bf16, by about one bf16 ulp of their scale.
BF16 = {"rtol": 2e-2, "atol": 4e-3, "norm": 2e-3}
FP32 = {"rtol": 1e-6, "atol": 1e-6, "norm": 1e-6}


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_zero_topo_over_the_3d_pmm_data_axis_equals_its_present_optimizer(world, bf16):
    """3D-PMM on grid (2, 1, 2, 2) with ZeRO-topo (unquantized) sharding over its data axis equals
    3D-PMM with DeepSpeed's ZeRO-1 in the same dtype (fp32 within 1e-6, bf16 within ``BF16``: losses,
    global norms with clipping active, every shard of every parameter); the ledger equals 3D-PMM's
    analytic model (without DeepSpeed's data-axis all-reduce) plus ZeRO-topo's, on every phase and
    level."""
    import torch

    tol = BF16 if bf16 else FP32
    ref = world.run(_pmm, None, bf16)
    ours = world.run(_pmm, {"preset": "zero_topo", **UNQUANTIZED}, bf16)
    for r, o in zip(ref, ours):
        assert o["losses"] == pytest.approx(r["losses"], rel=tol["norm"], abs=0)
        assert o["norms"] == pytest.approx(r["norms"], rel=tol["norm"], abs=0)
        assert r["norms"][0] > 0.05  # the clip is active
        assert bf16 or (o["still"] == [] and r["still"] == [])
        for name, p in r["params"].items():
            assert o["params"][name].dtype == (torch.bfloat16 if bf16 else torch.float32)
            torch.testing.assert_close(o["params"][name], p, rtol=tol["rtol"], atol=tol["atol"], msg=name)
        assert o["measured"] == o["analytic"]
    held = {n for o in ours for n in o["masters_held"]}
    assert held == set(ours[0]["params"]) and held == {n for o in ours for n in o["masters_moved"]}
    assert "data-parallel group" in ours[0]["describe"]
