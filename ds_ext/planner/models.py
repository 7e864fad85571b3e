"""Model catalogue: GPT shapes and their published batch recipes, each with its source.

A GPT here is ds_ext's block (``ds_ext.models.gpt``; GPT-NeoX and Megatron have the same
parameters): per layer two LayerNorms, fused q|k|v, attention-out, FC1 and FC2 with biases,
``(4 + 2 f) h^2 + (9 + f) h`` parameters for FFN width f h (12 h^2 + 13 h at f = 4); the root
holds the token table (V h), an untied head (V h more, GPT-NeoX ``no-weight-tying``), learned
positions (s h, absent with rotary) and the final LayerNorm (2 h). An MoE (001 §7.1.1) gives
every alternate layer's FFN ``experts`` copies and a top-1 gate (h E weights).

Recipes: sequences per optimizer step, either a fixed global batch or a batch per rank (so
the global batch grows with the ranks, as GPT-NeoX does when a yml runs on more GPUs), and
the gradient accumulation steps (``None``: the planner picks the fewest that fit).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError, model_validator

from ds_ext.perf.pmm import TABLE_5_1
from ds_ext.planner import PlannerError


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Recipe(_Frozen):
    """Batch of one optimizer step (exactly one of ``global_batch`` / ``batch_per_rank``)."""

    global_batch: PositiveInt | None = Field(None, description="Sequences per optimizer step.")
    batch_per_rank: PositiveInt | None = Field(None, description="Sequences per rank per optimizer step.")
    grad_accum: PositiveInt | None = Field(None, description="Micro-steps per optimizer step; None = fewest that fit.")
    megatron: tuple[PositiveInt, PositiveInt] | None = Field(
        None, description="Published (TP, PP) of a Megatron recipe."
    )
    micro_batch: PositiveInt | None = Field(None, description="The Megatron recipe's micro-batch.")
    source: str = "ds_ext default: one sequence per rank"

    @model_validator(mode="after")
    def _one_batch(self) -> "Recipe":
        if (self.global_batch is None) == (self.batch_per_rank is None):
            raise ValueError("a recipe gives exactly one of global_batch and batch_per_rank")
        return self

    replica_ranks: PositiveInt | None = Field(None, description="global_batch is per this many ranks (weak scaling).")

    def sequences(self, world: int) -> int:
        if self.batch_per_rank is not None:
            return self.batch_per_rank * world
        if self.replica_ranks is not None and world >= self.replica_ranks and world % self.replica_ranks == 0:
            return self.global_batch * world // self.replica_ranks  # type: ignore[operator]
        return self.global_batch  # type: ignore[return-value]


class Arch(_Frozen):
    """A GPT (or a GPT-based MoE) shape."""

    name: str
    layers: PositiveInt
    hidden: PositiveInt
    heads: PositiveInt
    vocab: PositiveInt
    seq: PositiveInt
    ffn_mult: PositiveInt = 4
    tied_embeddings: bool = True
    learned_positions: bool = True
    experts: PositiveInt = Field(1, description="Experts of every alternate layer's FFN (1: dense).")
    source: str = "command line"
    recipe: Recipe = Recipe(batch_per_rank=1)

    @model_validator(mode="after")
    def _heads_divide(self) -> "Arch":
        if self.hidden % self.heads:
            raise ValueError(f"--hidden {self.hidden} must be divisible by --heads {self.heads}")
        return self

    @property
    def ffn_params(self) -> int:
        """One FFN (FC1 + FC2 with biases)."""
        h, f = self.hidden, self.ffn_mult * self.hidden
        return 2 * h * f + f + h

    @property
    def block_params(self) -> int:
        """One dense transformer block: (4 + 2 f) h^2 + (9 + f) h."""
        h = self.hidden
        return 4 * h + 4 * h * h + 4 * h + self.ffn_params

    @property
    def root_params(self) -> int:
        """Parameters outside the blocks: tables, head, final LayerNorm."""
        h = self.hidden
        return (
            self.vocab * h * (1 if self.tied_embeddings else 2)
            + (self.seq * h if self.learned_positions else 0)
            + 2 * h
        )

    @property
    def moe_layers(self) -> int:
        return self.layers // 2 if self.experts > 1 else 0

    @property
    def expert_params(self) -> int:
        """NP_exp: every expert FFN of every MoE layer (001 Eq 7.2 counts the same)."""
        return self.moe_layers * self.experts * self.ffn_params

    @property
    def params(self) -> int:
        """Every parameter: dense blocks, MoE blocks (experts + gate), root."""
        dense = self.layers * self.block_params
        moe = self.moe_layers * ((self.experts - 1) * self.ffn_params + self.hidden * self.experts)
        return dense + moe + self.root_params


def _gpt3_like(name: str, layers: int, hidden: int, heads: int, source: str, recipe: Recipe) -> Arch:
    """Megatron / LitGPT GPT-3 style: GPT-2 vocabulary padded to 50304, 2048 tokens, tied head, learned positions."""
    return Arch(
        name=name, layers=layers, hidden=hidden, heads=heads, vocab=50304, seq=2048, source=source, recipe=recipe
    )


_NEOX = dict(tied_embeddings=False, learned_positions=False)
_000_BATCH = Recipe(global_batch=8192, source="000 Table I: 16.8M tokens per batch = 8192 x 2048")

CATALOGUE: dict[str, Arch] = {
    "gpt-neox-20b": Arch(
        name="gpt-neox-20b",
        layers=44,
        hidden=6144,
        heads=64,
        vocab=50432,
        seq=2048,
        **_NEOX,
        source="003 Figs 7, 9 (GPT-NeoX-20B); shape from GPT-NeoX configs/20B.yml",
        recipe=Recipe(
            batch_per_rank=128,
            grad_accum=32,
            megatron=(2, 4),
            micro_batch=4,
            source="GPT-NeoX configs/20B.yml's per-GPU keys, micro-batch 4 x 32 accumulation steps on "
            "every rank (49,152 sequences at 384 GCDs); 20B.yml's own run is 1,536 sequences "
            "(96 A100, pipeline 4 x tensor 2, 12 replicas); 003 states no batch",
        ),
    ),
    "gpt-neox-10b": Arch(
        name="gpt-neox-10b",
        layers=192,
        hidden=2048,
        heads=16,
        vocab=50432,
        seq=4096,
        **_NEOX,
        source="003 Figs 8, 10 (shape not given); GPT-NeoX configs/10B-pp-scaling.yml, the repository's 10B",
        recipe=Recipe(batch_per_rank=1, grad_accum=1, source="GPT-NeoX configs/10B-pp-scaling.yml: micro-batch 1"),
    ),
    "gpt-22b": _gpt3_like(
        "gpt-22b",
        48,
        6144,
        48,
        "004 Table I",
        Recipe(
            global_batch=640,
            megatron=(2, 2),
            micro_batch=1,
            source="004 gives no 22B recipe: 175B's Table V GBS 640 and MBS 1, TP 2 x PP 2 the planner's first "
            "choice there (configs/frontier/gpt_22b_004.recipe; an assumption)",
        ),
    ),
    "gpt-175b": _gpt3_like(
        "gpt-175b",
        96,
        12288,
        96,
        "004 Table I",
        Recipe(global_batch=640, megatron=(4, 16), micro_batch=1, source="004 Table V: GBS 640, TP 4, PP 16, MBS 1"),
    ),
    "gpt-1t": _gpt3_like(
        "gpt-1t",
        128,
        25600,
        128,
        "004 Table I",
        Recipe(
            global_batch=1600,
            megatron=(8, 64),
            micro_batch=1,
            replica_ranks=512,
            source="004 Table V: GBS 1600, TP 8, PP 64, MBS 1, per 512-GCD replica (004 §V-C1: "
            "3,200 / 6,400 / 9,600 at 1,024 / 2,048 / 3,072 GCDs)",
        ),
    ),
    **{
        name: _gpt3_like(name, L, h, a, "000 Table II / 001 Table 5.1", _000_BATCH)
        for name, (L, h, a) in TABLE_5_1.items()
    },
    # 001 Table 4.1 (GPT-3 shapes from Brown et al. 2020 Table 2.1): the MoE base models of Fig 7.9
    "gpt3-1.3b": _gpt3_like(
        "gpt3-1.3b",
        24,
        2048,
        16,
        "001 Table 4.1 (GPT-3 XL; Brown et al. print 24 heads of 128, which is not 2048)",
        Recipe(global_batch=512, source="001 Table 4.1"),
    ),
    "gpt3-2.7b": _gpt3_like(
        "gpt3-2.7b", 32, 2560, 32, "001 Table 4.1", Recipe(global_batch=512, source="001 Table 4.1")
    ),
    "gpt3-6.7b": _gpt3_like(
        "gpt3-6.7b", 32, 4096, 32, "001 Table 4.1", Recipe(global_batch=1024, source="001 Table 4.1")
    ),
    "gpt3-13b": _gpt3_like(
        "gpt3-13b",
        40,
        5120,
        40,
        "001 Table 4.1 (Brown et al. print 5140, not divisible by 40 heads)",
        Recipe(global_batch=2048, source="001 Table 4.1"),
    ),
}


class ModelError(PlannerError):
    """An unknown model name or an invalid shape; the message names the argument."""


def lookup(name: str) -> Arch:
    try:
        return CATALOGUE[name]
    except KeyError:
        raise ModelError(f"--model: unknown model {name!r}; allowed: {', '.join(CATALOGUE)}") from None


def with_experts(base: Arch, experts: int) -> Arch:
    """The MoE of 001 §7.1.1 built on ``base``: every alternate FFN becomes ``experts`` experts."""
    if experts < 1:
        raise ModelError(f"--experts: {experts} must be >= 1")
    if experts == 1:
        return base
    return base.model_copy(update={"name": f"{base.name}-moe{experts}", "experts": experts})


def custom(**shape) -> Arch:
    """A shape from the command line (``--layers --hidden --heads --vocab --seq`` ...)."""
    try:
        return Arch(name="custom", **shape)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise ModelError(
            f"--{where.replace('_', '-')}: {first['msg']}" if where else first["msg"].removeprefix("Value error, ")
        ) from None
