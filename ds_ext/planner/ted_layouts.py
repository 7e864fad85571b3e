"""TED layouts as planner candidates for MoE models (001 §7.1, §7.3; ``ds_ext.perf.ted``).

A layout is (G_tensor, G_expert, G_data^exp) with G_tensor G_expert G_data^exp = W (Eq 7.1),
G_tensor dividing a node (001 §7.1.1) and the heads, hidden and FFN sizes, G_expert dividing
the experts; ZeRO-1 over the data groups, as 001 §7.1.1 trains. The model is
``ds_ext.models.gpt_moe``: every alternate block's FFN is an MoE of E experts with a top-1 gate,
attention and FFNs are Megatron tensor-parallel (column: weight and bias split, row: weight
split, bias whole), embeddings, positions, norms and the gate replicated.

Memory per rank: Eq 7.4 of the parameters the rank holds (``perf.ted.eq_7_4``): 2 + 2 bytes
per parameter of 16-bit weights and gradients, 12 / G_data bytes of the fp32 master and Adam
moments, G_data^nonexp = G_expert G_data^exp for non-expert and G_data^exp for expert ones.

Bytes per level per optimizer step, for micro-batches of b sequences (S = b s tokens,
capacity C = ceil(S / E), top-1, capacity factor 1 as in 001's runs, DTD and CAC on, activation
checkpointing):

* every MoE block: ``perf.ted.moe_block_traffic`` (attention's all-reduce ❷ and the expert
  all-reduce ❻ over the tensor group, the two all-to-alls over the expert group, DTD's
  all-gathers), the per-block model the TED ledger tests hold the engine to;
* every dense block, G_tensor > 1: Megatron's two forward all-reduces (attention out, FC2) and
  two backward ones (the *f* of QKV and FC1) of S h b bytes; CAC replays the recompute's;
* per step (DeepSpeed's ZeRO-1 as the ledger measures it): an all-reduce of the 16-bit
  gradients, 2 n e (d - 1) / d, and an all-gather of the updated weights, n e (d - 1) / d, over
  the non-expert data group for non-expert parameters and over the expert-data group for
  expert ones (DeepSpeed's few-byte gradient-norm and overflow all-reduces are left out).
"""

from __future__ import annotations

from collections import defaultdict

from ds_ext.comm.emulation import message_steps
from ds_ext.comm.ledger import all_reduce_bytes
from ds_ext.parallel import TEDLayout
from ds_ext.perf.compute import ActivationSplit, activation_bytes
from ds_ext.perf.ted import MoEBlockShape, eq_7_4, moe_block_traffic
from ds_ext.planner.estimate import Candidate, Dropped, Job, Traffic, divisors
from ds_ext.planner.models import Arch
from ds_ext.topology import Topology

DTD, CAC = True, True  # 001 §7.3: both on in every TED run the planner proposes


def rank_params(arch: Arch, tensor: int, expert: int) -> tuple[int, int]:
    """(non-expert, expert) parameters one rank holds (module docstring)."""
    h, f, T = arch.hidden, arch.ffn_mult * arch.hidden, tensor
    attention = 4 * h + (3 * h * h + 3 * h) // T + h * h // T + h  # 2 norms, QKV (column), out (row)
    ffn = (h * f + f) // T + f * h // T + h  # FC1 (column) + FC2 (row, bias whole)
    dense = arch.layers - arch.moe_layers
    nonexp = arch.layers * attention + dense * ffn + arch.moe_layers * h * arch.experts + arch.root_params
    exp = arch.moe_layers * (arch.experts // expert) * ffn
    return nonexp, exp


def states(arch: Arch, layout: TEDLayout) -> dict[str, float]:
    """Model-state bytes per rank, Eq 7.4 split into its terms."""
    s = eq_7_4(*rank_params(arch, layout.tensor, layout.expert), layout)
    return {"weights": s.params, "secondary": 0.0, "gradients": s.grads, "optimizer": s.optimizer}


def block_shape(arch: Arch, micro: int, elem_bytes: int) -> MoEBlockShape:
    tokens = micro * arch.seq
    return MoEBlockShape(tokens, arch.hidden, arch.experts, -(-tokens // arch.experts), elem_bytes)


def micro_traffic(
    arch: Arch, layout: TEDLayout, topology: Topology, micro: int, elem_bytes: int, checkpointing: bool = True
) -> Traffic:
    """Bytes and messages rank 0 sends in forward + backward of one micro-step, per level:
    the MoE blocks (``perf.ted``) and the dense blocks' tensor-parallel all-reduces."""
    levels = layout.levels(topology, 0)
    group = {"all_to_all": layout.expert, "all_reduce": layout.tensor, "all_gather": layout.tensor}
    nbytes: dict[str, float] = defaultdict(float)
    messages: dict[str, float] = defaultdict(float)
    block = moe_block_traffic(
        layout, topology, 0, block_shape(arch, micro, elem_bytes), dtd=DTD, cac=CAC, checkpointing=checkpointing
    )
    for key, b in block.bytes.items():
        _, op, level = key
        nbytes[level] += b * arch.moe_layers
        messages[level] += block.calls[key] * message_steps(op, group[op]) * arch.moe_layers
    T = layout.tensor
    if T > 1:
        calls = (arch.layers - arch.moe_layers) * (4 + (2 if checkpointing and not CAC else 0))
        A = micro * arch.seq * arch.hidden * elem_bytes
        nbytes[levels["tensor"]] += calls * all_reduce_bytes(A, T)
        messages[levels["tensor"]] += calls * message_steps("all_reduce", T)
    return Traffic(dict(nbytes), dict(messages))


def step_traffic(arch: Arch, layout: TEDLayout, topology: Topology, elem_bytes: int) -> Traffic:
    """DeepSpeed ZeRO-1's gradient all-reduce (in the boundary micro-step's backward) and weight
    all-gather (after the step) of one optimizer step, per level."""
    levels = layout.levels(topology, 0)
    nbytes: dict[str, float] = defaultdict(float)
    messages: dict[str, float] = defaultdict(float)
    nonexp, exp = rank_params(arch, layout.tensor, layout.expert)
    for kind, d, n in (("data", layout.nonexp_data, nonexp), ("expert_data", layout.expert_data, exp)):
        if d > 1:
            nbytes[levels[kind]] += 3 * n * elem_bytes * (d - 1) / d  # all-reduce (2) + all-gather (1)
            messages[levels[kind]] += message_steps("all_reduce", d) + message_steps("all_gather", d)
    return Traffic(dict(nbytes), dict(messages))


def traffic(
    arch: Arch,
    layout: TEDLayout,
    topology: Topology,
    micro: int,
    grad_accum: int,
    elem_bytes: int,
    checkpointing: bool = True,
) -> Traffic:
    """Per optimizer step: ``grad_accum`` micro-steps and the step (module docstring)."""
    m = micro_traffic(arch, layout, topology, micro, elem_bytes, checkpointing)
    s = step_traffic(arch, layout, topology, elem_bytes)
    return Traffic(
        {lv: m.bytes.get(lv, 0.0) * grad_accum + s.bytes.get(lv, 0.0) for lv in {*m.bytes, *s.bytes}},
        {lv: m.messages.get(lv, 0.0) * grad_accum + s.messages.get(lv, 0.0) for lv in {*m.messages, *s.messages}},
    )


def layouts(arch: Arch, topology: Topology) -> tuple[list[TEDLayout], list[Dropped]]:
    """Every (G_tensor, G_expert, G_data^exp) of the module docstring on ``topology``; the
    (G_tensor, G_expert) pairs that break a constraint are returned as dropped, with the reason."""
    node = topology.ranks_per_node if len(topology.levels) > 1 else topology.world_size
    f = arch.ffn_mult * arch.hidden
    out, dropped = [], []
    for T in divisors(node):
        for P in divisors(arch.experts):
            sizes = {"heads": arch.heads, "hidden": arch.hidden, "ffn": f}
            bad = [f"{k} {v}" for k, v in sizes.items() if v % T]
            if bad:
                reason = f"G_tensor {T} does not divide {', '.join(bad)}"
            elif topology.world_size % (T * P):
                reason = f"G_tensor x G_expert = {T * P} does not divide {topology.world_size} ranks"
            else:
                out.append(TEDLayout.build(topology.world_size, T, P))
                continue
            dropped.append(Dropped("ted", f"ted {T}x{P}", reason))
    return out, dropped


def candidate(job: Job, layout: TEDLayout) -> Candidate:
    a, e = job.arch, job.elem_bytes
    split = ActivationSplit(tensor=layout.tensor)
    return Candidate(
        family="ted",
        name=f"ted {layout.tensor}x{layout.expert}x{layout.expert_data}",
        config={
            "zero_optimization": {"stage": 1},
            "ds_ext": {
                "ted": {
                    "enabled": True,
                    "tensor_parallel": layout.tensor,
                    "expert_parallel": layout.expert,
                    "num_experts": a.experts,
                    "duplicate_token_dropping": DTD,
                    "comm_aware_checkpointing": CAC,
                }
            },
        },
        data=layout.nonexp_data,
        states=states(a, layout),
        activations=lambda b: activation_bytes(
            b * a.seq, a.layers, a.hidden, a.heads, a.seq, a.vocab, split, job.checkpointing
        ),
        traffic=lambda b, g: traffic(a, layout, job.topology, b, g, e, job.checkpointing),
    )


def candidates(job: Job) -> tuple[list[Candidate], list[Dropped]]:
    """Every layout of an MoE; none for a dense model (the ZeRO-topo and 3D-PMM families plan it)."""
    if job.arch.experts == 1:
        return [], [Dropped("ted", "ted", "a dense model (no experts): the zero and pmm3d families plan it")]
    good, dropped = layouts(job.arch, job.topology)
    return [candidate(job, lay) for lay in good], dropped
