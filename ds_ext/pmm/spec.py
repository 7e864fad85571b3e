"""The shapes :mod:`ds_ext.perf.pmm` needs, read from a serial model and its plan."""

from __future__ import annotations

from torch import nn

from ds_ext.perf.pmm import LayerSpec, ModelSpec, NormSpec, TableSpec, place_tables
from ds_ext.pmm.plans import Plan


def _recomputed(model: nn.Module, name: str) -> bool:
    """Inside an activation-checkpointed block of ds_ext's GPT (recomputed in backward)."""
    cfg = getattr(model, "cfg", None)
    return bool(getattr(cfg, "checkpoint", False)) and name.startswith("blocks.")


def model_spec(model: nn.Module, plan: Plan, vocab_parallel: bool = True) -> ModelSpec:
    """Layers, norms, tables and the head of a serial ``model`` converted by ``plan``; the tables
    vocabulary-parallel or (``vocab_parallel`` False) replicated over X."""
    layers, norms, tables = [], [], []
    head = None
    table_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for name, m in model.named_modules():
        last = name.rsplit(".", 1)[-1]
        if isinstance(m, nn.Linear) and name == plan.head:
            head = LayerSpec(name, m.in_features, m.out_features)
            if id(m.weight) not in table_ids:
                tables.append(TableSpec(name, m.out_features, m.in_features, lookup=False))
        elif isinstance(m, nn.Linear) and last in plan.linears:
            style = plan.linears[last]
            layers.append(
                LayerSpec(
                    name,
                    m.in_features,
                    m.out_features,
                    style.transposed,
                    m.bias is not None,
                    style.out_chunks,
                    _recomputed(model, name),
                )
            )
        elif isinstance(m, nn.Embedding):
            tables.append(TableSpec(name, m.num_embeddings, m.embedding_dim, per_position=name in plan.positions))
            if name == plan.tied_head:
                head = LayerSpec(name, m.embedding_dim, m.num_embeddings)
        elif isinstance(m, nn.LayerNorm):
            params = (m.weight is not None) + (m.bias is not None)
            norms.append(NormSpec(name, m.normalized_shape[0], 2, params, _recomputed(model, name)))
        elif type(m).__name__.endswith("RMSNorm"):
            norms.append(NormSpec(name, m.weight.shape[0], 1, 1, _recomputed(model, name)))
    spec = ModelSpec(tuple(layers), tuple(norms), tuple(tables), head, dict(plan.heads))
    return place_tables(spec, vocab_parallel)
