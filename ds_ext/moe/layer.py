"""``TEDMoE``: a drop-in for ``deepspeed.moe.layer.MoE`` with TED's 3-D parallelism (001 §7.1).

Same constructor arguments, same return ``(output, l_aux, exp_counts)``, same state-dict
keys (``deepspeed_moe.gate.wg.weight``, ``deepspeed_moe.experts.deepspeed_experts.<i>...``)
and a subclass of DeepSpeed's ``MoE``, so DeepSpeed's engine treats it as one (expert
parameter groups, expert-data gradient reduction, MoE checkpoints).

Forward of one rank in three stages, as megatron-core's MoE layer (001 Fig 7.3; T = G_tensor,
P = G_expert, E = k P experts, S tokens):

  x ``[S, H]`` replicated over the tensor group
  router (:class:`~ds_ext.moe.gate.TopKGate`) ❸ gate -> routing (identical on the tensor group)
  dispatcher (:mod:`ds_ext.moe.dispatcher`) encode -> ``[E, C, H]`` ; ❹ all-to-all over the
     expert group (DTD: drop / all-to-all / all-gather) -> ``[P, k, C, H]``: the slots of my k
     experts from each expert rank
  experts (:mod:`ds_ext.moe.experts`) ❺ column-parallel fc1, activation, row-parallel fc2 of each
     local expert (its T-th shard) ; ❻ all-reduce over the tensor group -> expert outputs
     replicated over the tensor group
  dispatcher ❼ all-to-all back (DTD as in ❹) -> ``[E, C, H]`` ; decode -> ``[S, H]``

With ``enable_expert_tensor_parallelism=False`` (DeepSpeed's and Megatron-DeepSpeed's default)
and G_tensor > 1 the experts stay whole on every tensor rank, as DeepSpeed runs them: each
tensor rank keeps its ``C/T`` slots of the dispatched buffer (duplicate token dropping, now a
correctness requirement: no rank may run a token twice), all-to-all over the expert group, runs
the whole experts on its slots (no ❻), all-to-all back, and the tensor group all-gathers the
slots. Their gradients, one slot chunk per tensor rank, are then reduced over the
``expert_replicas`` group (G_tensor x G_data^exp), which TED registers as DeepSpeed's expert
data-parallel group. They are one replicated parameter: binding broadcasts tensor rank 0's copy
over the tensor group (Megatron-DeepSpeed initializes each tensor rank's copy differently;
DeepSpeed's own MoE keeps those different copies and reduces their gradients over the expert
data-parallel group only).

Experts the client built tensor-parallel (Megatron-DeepSpeed's ``ParallelMLP(config, moe=True,
enable_expert_tensor_parallelism=True)``: their layers hold their shards, marked
``tensor_model_parallel``) are not sliced again and run their own f / g (❻) over Megatron's
tensor group, which must be TED's (T consecutive ranks, as both order them); those collectives
bypass the ds_ext ledger and CAC. Experts kept whole lose any such marks, so gradient norms
count them once per tensor group.

Built whole (serial semantics, ``ep_size`` local copies of ``expert`` as DeepSpeed does);
``ds_ext.initialize`` with ``"ted"`` enabled binds it to the TED layout (``ted_bind``), which
slices the experts for the tensor group. Unbound with ``ep_size > 1`` it refuses to run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ds_ext.errors import DsExtSetupError
from ds_ext.integration import ds_moe
from ds_ext.moe import TEDError
from ds_ext.moe.cac import Tape
from ds_ext.moe.context import TEDContext
from ds_ext.moe.dispatcher import TokenDispatcher, token_dispatcher
from ds_ext.moe.experts import Experts, run_mlp
from ds_ext.moe.gate import TopKGate, all_reduce_max
from ds_ext.moe.tensor_parallel import check_tensor_parallel_mlp, shard_column_, shard_row_
from ds_ext.parallel import TEDLayout

# Gate noise seeds: distinct per layer and per batch shard, equal on a tensor group.
_LAYER_STRIDE, _SHARD_STRIDE = 1_000_003, 7_919


class MoEBody(nn.Module):
    """DeepSpeed's ``deepspeed_moe`` attribute: the gate and the experts."""

    def __init__(self, gate: TopKGate, experts: Experts) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts


class TEDMoE(ds_moe.MoEBase):
    """Tensor x expert x data parallel MoE layer (see module docstring).

    Arguments are DeepSpeed's (``deepspeed.moe.layer.MoE``), any ``k`` (DeepSpeed's
    ``topkgating`` for k >= 3, with its ``drop_policy``). Not supported, each refused
    with one line: ``use_tutel=True``; with tensor parallelism and
    ``enable_expert_tensor_parallelism=True``, an expert that is neither
    ``nn.Sequential(Linear, elementwise activation, Linear)`` nor built tensor-parallel by the
    client (module docstring); with tensor parallelism and
    ``enable_expert_tensor_parallelism=False``, ``duplicate_token_dropping`` off.
    """

    def __init__(
        self,
        hidden_size: int,
        expert: nn.Module,
        num_experts: int = 1,
        ep_size: int = 1,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 4,
        use_residual: bool = False,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        use_tutel: bool = False,
        enable_expert_tensor_parallelism: bool = False,
        top2_2nd_expert_sampling: bool = True,
        drop_policy: str = "probs",
    ) -> None:
        nn.Module.__init__(self)
        if ep_size < 1 or num_experts % ep_size:
            raise TEDError(
                f"ds_ext.ted: num_experts {num_experts} must be a multiple of the expert-parallel "
                f"size ep_size {ep_size}"
            )
        if use_tutel:
            raise TEDError("ds_ext.ted: use_tutel=True is not supported (Tutel kernels are CUDA-only); allowed: False")
        self.hidden_size = hidden_size
        self.num_experts = num_experts
        self.ep_size = ep_size
        self.num_local_experts = num_experts // ep_size
        self.expert_group_name = ds_moe.expert_group_name(ep_size)
        self.enable_expert_tensor_parallelism = enable_expert_tensor_parallelism
        self.use_residual = use_residual
        gate = TopKGate(
            hidden_size,
            num_experts,
            k,
            capacity_factor,
            eval_capacity_factor,
            min_capacity,
            noisy_gate_policy,
            drop_tokens,
            use_rts,
            top2_2nd_expert_sampling,
            drop_policy,
        )
        # Megatron's tensor-parallel marks of a client-built expert (a deep copy loses them)
        self._client_marks = [
            (
                getattr(p, "tensor_model_parallel", False),
                getattr(p, "partition_dim", -1),
                getattr(p, "partition_stride", 1),
            )
            for p in expert.parameters()
        ]
        self.deepspeed_moe = MoEBody(gate, Experts(expert, self.num_local_experts, self.expert_group_name))
        if use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)
        self.ted: TEDContext | None = None
        self.ted_tape = Tape("TEDMoE")
        self.expert_partitioning = "whole"
        self.dispatcher = TokenDispatcher(None, num_experts)

    @property
    def gate(self) -> TopKGate:
        return self.deepspeed_moe.gate

    @property
    def local_experts(self) -> nn.ModuleList:
        return self.deepspeed_moe.experts.deepspeed_experts

    def _mlps(self) -> list[nn.Module]:
        return list(self.local_experts) + ([self.mlp] if self.use_residual else [])

    # ---- binding to a TED layout (ds_ext.moe.plugin) --------------------------------------
    def ted_validate(self, layout: TEDLayout, name: str) -> None:
        """Pure checks against the layout, before any process group exists."""
        if self.ep_size != layout.expert:
            raise TEDError(
                f"ds_ext.ted: {name} has ep_size {self.ep_size} but ds_ext.ted.expert_parallel is "
                f"{layout.expert}; allowed: ep_size == expert_parallel"
            )
        if layout.tensor == 1 or not self.enable_expert_tensor_parallelism or self._client_partitioned():
            return
        for i, mlp in enumerate(self._mlps()):
            check_tensor_parallel_mlp(mlp, f"{name} expert {i}")
            if mlp[0].out_features % layout.tensor:
                raise TEDError(
                    f"ds_ext.ted: {name} expert hidden size {mlp[0].out_features} is not divisible by "
                    f"tensor_parallel {layout.tensor}"
                )

    def check_token_dropping(self, tensor: int, dtd: bool, name: str) -> None:
        """Whole experts beside tensor parallelism need DTD (module docstring)."""
        if tensor > 1 and not dtd and not self.enable_expert_tensor_parallelism:
            raise TEDError(
                f"ds_ext.ted: {name} keeps its experts whole on every tensor rank "
                f"(enable_expert_tensor_parallelism=False) at tensor_parallel {tensor}, so each tensor rank "
                "must run only its share of the tokens: duplicate_token_dropping must be true (DeepSpeed "
                "drops them too); allowed: true"
            )

    def ted_bind(self, ted: TEDContext, index: int) -> None:
        """Slice the experts for this tensor rank and attach the TED groups."""
        T = ted.layout.tensor
        self.check_token_dropping(T, ted.dtd, f"TEDMoE[{index}]")
        self.expert_partitioning = (
            "whole"
            if T == 1 or not self.enable_expert_tensor_parallelism
            else "client"
            if self._client_partitioned()
            else "ted"
        )
        if self.expert_partitioning == "whole":
            _mark_whole(self._mlps())
            if T > 1:
                self._replicate_whole(ted)
        if self.expert_partitioning == "client":
            for mlp in self._mlps():
                for p, (mark, dim, stride) in zip(mlp.parameters(), self._client_marks, strict=True):
                    p.tensor_model_parallel, p.partition_dim, p.partition_stride = mark, dim, stride
        if self.expert_partitioning == "ted":
            for mlp in self._mlps():
                shard_column_(mlp[0], ted.tensor_rank, T)
                shard_row_(mlp[2], ted.tensor_rank, T)
            self.deepspeed_moe.experts.tensor_parallel = ted
        self.dispatcher = token_dispatcher(ted, self.num_experts, self.sliced(T))
        gate = self.gate
        gate.seed = ted.seed + _LAYER_STRIDE * index + _SHARD_STRIDE * ted.data_rank
        gate.tensor_parallel = T
        if ted.layout.expert > 1:
            gate.agree_capacity = all_reduce_max(ted.comm, ted.groups.expert)
        self.ted = ted
        self.ted_tape = Tape(f"TEDMoE[{index}]")

    def count_zero_partitions(self) -> None:
        """ZeRO-1/2 partition whole experts beside tensor parallelism over their gradient group,
        ``expert_replicas`` (tensor x expert-data), so every rank's partition is distinct; DeepSpeed's
        norm (``get_grad_norm_direct``) counts a partition on tensor rank 0 only unless the parameter
        is model-parallel (``is_model_parallel_parameter``: the ``model_parallel`` mark), and would
        miss the other tensor ranks' partitions. ds_ext's own norms read ``tensor_model_parallel``."""
        if self.expert_partitioning == "whole" and self.ted.layout.tensor > 1:
            for mlp in self._mlps():
                for p in mlp.parameters():
                    p.model_parallel = True

    def _replicate_whole(self, ted: TEDContext) -> None:
        """Whole experts are one parameter replicated over the tensor group (their gradients are
        reduced over ``expert_replicas``), so every tensor rank must start from the same copy:
        tensor rank 0's is broadcast. Megatron-DeepSpeed initializes ``ParallelMLP(moe=True)``
        from its per-tensor-rank RNG (``_initialize_affine_weight_gpu``), so its copies differ."""
        src = ted.ranks("tensor")[0]
        with torch.no_grad():
            for mlp in self._mlps():
                for p in mlp.parameters():
                    ted.comm.broadcast(p.data, src=src, group=ted.groups.tensor)

    def _client_partitioned(self) -> bool:
        """Experts the client built tensor-parallel (Megatron-DeepSpeed's ``ParallelMLP(moe=True,
        enable_expert_tensor_parallelism=True)``: its layers hold their shards, marked
        ``tensor_model_parallel``, and run their own collectives over Megatron's tensor group)."""
        return any(mark for mark, _, _ in self._client_marks)

    def sliced(self, tensor: int) -> bool:
        """Whether the experts are split over a tensor group of ``tensor`` ranks."""
        return tensor > 1 and self.expert_partitioning != "whole"

    @property
    def expert_data_group_kind(self) -> str:
        """The TED group that reduces the expert gradients: ``expert_data``, or ``expert_replicas``
        for whole experts beside tensor parallelism (module docstring)."""
        T = self.ted.layout.tensor
        return "expert_replicas" if T > 1 and not self.sliced(T) else "expert_data"

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """Called by DeepSpeed's engine: register TED's expert groups under DeepSpeed's name."""
        if self.ted is None:
            raise DsExtSetupError(
                "ds_ext.ted: TEDMoE reached deepspeed.initialize unbound; build the engine with "
                'ds_ext.initialize and "ds_ext": {"ted": {"enabled": true, ...}}'
            )
        if use_data_before_expert_parallel_:
            raise TEDError(
                "ds_ext.ted: use_data_before_expert_parallel_ is not supported; TED places expert "
                "groups inside the non-expert data groups (001 §7.1); allowed: false"
            )
        ted, kind = self.ted, self.expert_data_group_kind
        ds_moe.register_expert_groups(
            self.expert_group_name,
            ted.groups.expert,
            ted.ranks("expert"),
            ted.groups[kind],
            ted.ranks(kind),
            ted.layout.tensor if self.sliced(ted.layout.tensor) else 1,
        )

    # ---- forward ---------------------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None):
        """``hidden_states`` ``[..., H]`` -> ``(output [..., H], l_aux, exp_counts)``."""
        ted = self.ted
        if ted is None and self.ep_size > 1:
            raise DsExtSetupError(
                f"ds_ext.ted: TEDMoE(ep_size={self.ep_size}) runs only once bound by "
                'ds_ext.initialize with "ted" enabled'
            )
        x = hidden_states.reshape(-1, self.hidden_size)
        frame = self.ted_tape.frame(ted.cac if ted is not None else False)
        routing = self.gate(x, used_token, frame)  # router
        tokens, route_slots = self.dispatcher.dispatch(x, routing, frame)
        C = tokens.shape[1]
        y = self.deepspeed_moe.experts(tokens.view(self.ep_size, self.num_local_experts, C, -1), frame)
        out = self.dispatcher.combine(y.reshape(self.num_experts, C, -1), route_slots, routing, frame)
        if self.use_residual:
            coef = F.softmax(self.coefficient(x), dim=-1)
            residual = run_mlp(self.mlp, x, self.deepspeed_moe.experts.tensor_parallel, frame)
            out = out * coef[..., 0:1] + residual * coef[..., 1:]
        return out.reshape(hidden_states.shape), routing.l_aux, routing.decision.exp_counts


def _mark_whole(mlps: list[nn.Module]) -> None:
    """Experts kept whole are not tensor-parallel, whatever marks their layers carry (Megatron's
    ``ParallelMLP(moe=True)`` marks its unsliced layers ``tensor_model_parallel`` too): DeepSpeed's
    and ds_ext's gradient norms must count them once per tensor group."""
    for mlp in mlps:
        for p in mlp.parameters():
            if getattr(p, "tensor_model_parallel", False):
                p.tensor_model_parallel = False
