"""TED's gate against DeepSpeed's own gate functions and the independent reference (no processes).

* capacity: ``drop_capacity`` equals DeepSpeed's ``_capacity`` (fp32) over a sweep of S, E, k and
  capacity factors, and so does the reference's formula;
* routing: for k = 1 .. 4, drop and dropless, with random token selection, RSample and top-2
  sampling on, TED's gate (its decision turned into GShard's dense combine weights), DeepSpeed's
  ``top1gating`` / ``top2gating`` / ``topkgating`` and the reference (tests/moe_reference.py)
  give the same combine weights, l_aux and expert counts; top-1 dropping without random token
  selection keeps the tokens DeepSpeed's ``top1gating`` keeps;
* the gate's arguments are validated where the layer is built; its draws follow the documented
  generator protocol and resume from the ``draws`` counter.
"""

import itertools
import math

import moe_reference as ref
import pytest
import torch

from ds_ext.errors import DsExtError, DsExtSetupError
from ds_ext.moe import TEDError

FACTORS = (0.1, 0.25, 0.3, 0.5, 0.7, 1.0, 1.1, 1.2, 1.25, 1.3, 1.5, 1.7, 2.0, 2.1, 3.3, 4.4)


def test_capacity_equals_deepspeed_fp32_sweep():
    """The old float64 ceil differed from DeepSpeed in thousands of cases (e.g. S 100, E 10, f 1.1)."""
    from deepspeed.moe.sharded_moe import _capacity

    from ds_ext.moe.gate import drop_capacity

    cases = differs_in_fp64 = 0
    gates = {}
    for S, E, k, f in itertools.product(range(1, 257, 3), (1, 2, 3, 4, 6, 8, 10, 16, 64), (1, 2, 3), FACTORS):
        if (S, E) not in gates:
            gates[S, E] = torch.empty(S, E)
        want = int(_capacity(gates[S, E], torch.tensor(f * k), torch.tensor(2)))
        assert drop_capacity(S, E, f, k, 2) == want, (S, E, k, f)
        assert ref.capacity(S, E, f, k, 2) == want, (S, E, k, f)
        cases += 1
        differs_in_fp64 += max(math.ceil(S / E * f * k), 2) != want  # the old formula
    assert cases == 86 * 9 * 3 * len(FACTORS) and differs_in_fp64 > 0
    assert drop_capacity(100, 10, 1.1, 1, 0) == int(_capacity(torch.empty(100, 10), torch.tensor(1.1), torch.tensor(0)))


def _dense(decision, gates, S, E):
    """TED's sparse routes -> GShard's combine weights [S, E, C]."""
    C = decision.capacity
    out = torch.zeros(S, E, C)
    for r in range(decision.indices.shape[0]):
        for s in range(S):
            e = int(decision.indices[r, s])
            if e >= 0:
                out[s, e, int(decision.locations[r, s])] += gates[r, s]
    return out


def _ted_gate(spec, wg, seed, draws):
    from ds_ext.moe.cac import Frame
    from ds_ext.moe.gate import TopKGate

    g = TopKGate(
        wg.shape[1],
        spec.num_experts,
        spec.k,
        spec.capacity_factor,
        spec.capacity_factor,
        spec.min_capacity,
        spec.noisy_gate_policy,
        spec.drop_tokens,
        spec.use_rts,
        spec.top2_2nd_expert_sampling,
        spec.drop_policy,
    )
    with torch.no_grad():
        g.wg.weight.copy_(wg)
    g.seed, g.draws = seed, draws
    return lambda x, used=None: g(x, used, Frame("gate", "plain", False))


def _deepspeed(spec, logits, used=None):
    from deepspeed.moe import sharded_moe as sm

    if spec.k == 1:
        return sm.top1gating(
            logits,
            spec.capacity_factor,
            spec.min_capacity,
            used,
            spec.noisy_gate_policy,
            spec.drop_tokens,
            spec.use_rts,
        )
    if spec.k == 2:
        return sm.top2gating(
            logits,
            spec.capacity_factor,
            spec.min_capacity,
            spec.drop_tokens,
            top2_2nd_expert_sampling=spec.top2_2nd_expert_sampling,
        )
    return sm.topkgating(
        logits, spec.k, spec.capacity_factor, spec.min_capacity, spec.drop_tokens, drop_policy=spec.drop_policy
    )


SPECS = [
    dict(k=1, use_rts=True),
    dict(k=1, use_rts=True, noisy_gate_policy="RSample"),
    dict(k=1, drop_tokens=False),
    dict(k=2),
    dict(k=2, top2_2nd_expert_sampling=True),
    dict(k=2, drop_tokens=False),
    dict(k=3),
    dict(k=3, drop_policy="position"),
    dict(k=4, drop_tokens=False),
    dict(k=3, capacity_factor=0.7),
]


@pytest.mark.parametrize("kw", SPECS, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_gate_equals_deepspeed_and_reference(kw):
    """DeepSpeed draws from the global generator: seeding it with s and handing TED / the reference
    the generator manual_seed(s) makes all three see the same noise (TED: seed s, draws 0).
    The reference's Gumbel formula and DeepSpeed's Uniform(tiny, 1 - eps) differ in the last bits,
    which does not move an argmax here."""
    for S, E, cf in ((24, 4, 1.0), (40, 8, 0.5), (17, 6, 1.3)):
        spec = ref.GateSpec(num_experts=E, **{"capacity_factor": cf, **kw})
        if spec.k > E:
            continue
        s = S * 7 + E
        wg = torch.randn(E, 16, generator=torch.Generator().manual_seed(s))
        x = torch.randn(S, 16, generator=torch.Generator().manual_seed(s + 1))
        used = (torch.arange(S) % 5 != 3).long() if spec.k <= 2 else None  # top-2: DeepSpeed ignores it
        torch.manual_seed(s)
        logits = x @ wg.t()
        l_aux, combine, _, counts = _deepspeed(spec, logits.clone(), used if spec.k == 1 else None)
        routing = _ted_gate(spec, wg, s, 0)(x, used)
        ted = _dense(routing.decision, routing.gates.detach(), S, E)
        mine = ref.gate(x, wg, spec, ref.generator(s, 0), used_token=used if spec.k == 1 else None)
        C = combine.shape[-1]
        assert routing.decision.capacity == C == mine.combine.shape[-1], (S, E)
        torch.testing.assert_close(ted, combine, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(mine.combine, combine, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(routing.l_aux, l_aux, rtol=1e-6, atol=0)
        torch.testing.assert_close(mine.l_aux, l_aux, rtol=1e-6, atol=0)
        assert torch.equal(routing.decision.exp_counts, counts) and torch.equal(mine.exp_counts, counts)
        assert combine.count_nonzero() > 0


TOP1_DROP = [
    (24, 4, 1.0, None, False),
    (40, 8, 0.5, None, False),
    (64, 4, 0.5, None, True),
    (100, 6, 0.75, None, False),
    (256, 8, 1.0, None, True),
    (17, 3, 0.5, "RSample", False),
    (128, 4, 0.25, "RSample", True),
    (512, 16, 1.0, None, False),
]


@pytest.mark.parametrize("S, E, cf, noise, with_used", TOP1_DROP)
def test_top1_drop_without_rts_keeps_deepspeeds_tokens(S, E, cf, noise, with_used):
    """Top-1, tokens dropped, ``use_rts=False`` (001 §7.1 step ❸): DeepSpeed's ``top1gating`` keeps
    the tokens ``torch.topk`` of the 0/1 route mask over the token dimension returns, not the
    first C by position; TED and the reference keep the same ones."""
    spec = ref.GateSpec(num_experts=E, k=1, capacity_factor=cf, noisy_gate_policy=noise, use_rts=False)
    s = 1000 + S * 7 + E
    wg = torch.randn(E, 16, generator=torch.Generator().manual_seed(s))
    x = torch.randn(S, 16, generator=torch.Generator().manual_seed(s + 1))
    used = (torch.arange(S) % 7 != 2).long() if with_used else None
    torch.manual_seed(s)  # RSample: DeepSpeed's global generator, TED's and the reference's manual_seed(s)
    _, combine, _, counts = _deepspeed(spec, x @ wg.t(), used)
    C = combine.shape[-1]
    assert int(counts.max()) > C  # tokens are dropped
    routing = _ted_gate(spec, wg, s, 0)(x, used)
    assert routing.decision.capacity == C
    torch.testing.assert_close(_dense(routing.decision, routing.gates.detach(), S, E), combine, rtol=1e-6, atol=1e-7)
    mine = ref.gate(x, wg, spec, ref.generator(s, 0), used_token=used)
    torch.testing.assert_close(mine.combine, combine, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "kw, msg",
    [
        (dict(capacity_factor=-1.0), "ds_ext.ted: capacity_factor must be a finite number > 0, got -1.0"),
        (dict(eval_capacity_factor=0.0), "ds_ext.ted: eval_capacity_factor must be a finite number > 0, got 0.0"),
        (dict(capacity_factor=float("nan")), "ds_ext.ted: capacity_factor must be a finite number > 0, got nan"),
        (dict(k=0), "ds_ext.ted: top_k (k) must be an integer in 1..num_experts (4), got 0"),
        (dict(k=5), "ds_ext.ted: top_k (k) must be an integer in 1..num_experts (4), got 5"),
        (dict(min_capacity=-1), "ds_ext.ted: min_capacity must be an integer >= 0, got -1"),
        (dict(drop_policy="random"), "ds_ext.ted: drop_policy must be one of 'probs', 'position'; got 'random'"),
        (
            dict(k=3, noisy_gate_policy="RSample"),
            "ds_ext.ted: noisy_gate_policy 'RSample' applies to top-1 gating only "
            "(DeepSpeed silently ignores it with k=3); allowed with k > 1: None, 'Jitter'",
        ),
    ],
)
def test_bad_gate_arguments_refused_where_the_layer_is_built(kw, msg):
    from torch import nn

    from ds_ext.moe import TEDMoE

    with pytest.raises(TEDError) as err:
        TEDMoE(8, nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8)), num_experts=4, **kw)
    assert str(err.value) == msg and isinstance(err.value, DsExtError) and isinstance(err.value, ValueError)


def test_an_unbound_expert_parallel_layer_is_a_setup_error():
    from torch import nn

    from ds_ext.moe import TEDMoE

    moe = TEDMoE(8, nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8)), num_experts=4, ep_size=2)
    with pytest.raises(DsExtSetupError, match=r"^ds_ext\.ted: TEDMoE\(ep_size=2\) runs only once bound"):
        moe(torch.zeros(8, 8))
    with pytest.raises(DsExtSetupError, match="reached deepspeed.initialize unbound"):
        moe.set_deepspeed_parallelism()


def test_draws_follow_the_generator_protocol_and_resume():
    """Forward n draws from manual_seed((seed + n 2654435761) mod 2^32): a gate whose counter is set
    to n draws what the n-th forward of an uninterrupted gate drew (what a checkpoint restores);
    gates of different seeds (other data shards, layers) draw different noise in the same forward
    (torch's CPU generator keeps only 32 bits of a seed: seed 2^32 + n would not)."""
    spec = ref.GateSpec(num_experts=4, k=1, use_rts=True, noisy_gate_policy="RSample", capacity_factor=0.5)
    wg = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    xs = torch.randn(3, 24, 16, generator=torch.Generator().manual_seed(1))
    shard = [_ted_gate(spec, wg, seed, 0)(xs[0]) for seed in (77, 77 + 7919, 77 + 1_000_003)]
    routes = [r.decision.indices for r in shard]
    assert not torch.equal(routes[0], routes[1]) and not torch.equal(routes[0], routes[2])
    run = _ted_gate(spec, wg, 77, 0)
    first = [_dense(r.decision, r.gates.detach(), 24, 4) for r in (run(x) for x in xs)]
    resumed = _ted_gate(spec, wg, 77, 2)(xs[2])
    assert torch.equal(_dense(resumed.decision, resumed.gates.detach(), 24, 4), first[2])
    for n, x in enumerate(xs):
        want = ref.gate(x, wg, spec, ref.generator(77, n)).combine
        torch.testing.assert_close(first[n], want, rtol=1e-6, atol=1e-7)
    assert not torch.equal(first[0], first[1]) or not torch.equal(first[1], first[2])
