"""``ds_ext.pmm.parallelize(model, engine)``: convert a model to 3D-PMM in place (001 §5.1.1).

* every ``nn.Linear`` named in the plan becomes a :class:`~ds_ext.pmm.linear.Linear`
  (normal or transposed), every ``nn.Embedding`` a vocabulary-parallel
  :class:`~ds_ext.pmm.vocab.Embedding`, the LM head a normal ``Linear`` ``d -> V`` (sharing
  the table's parameter when tied) whose logits are split over X (``vocab_parallel`` False,
  ``ds_ext.pmm3d.tables`` "replicated": tables and head whole over X), norms their Y-split forms
  (:mod:`ds_ext.pmm.layers`); all initialized by slicing the serial parameters;
* a Hugging Face model's loss becomes :func:`ds_ext.pmm.vocab.causal_lm_loss` (the
  cross-entropy of vocab-split logits; ds_ext's GPT: :class:`ds_ext.pmm.gpt.PMMGPT`);
* attention keeps n_heads / G_x heads per rank (the plan's head counts must divide by G_x);
* the model's forward takes the *data-parallel group's* micro-batch on every tensor rank
  (like Megatron's tensor parallelism) and keeps this rank's Z share of the rows (dim 0 of
  every batch tensor); a returned loss (a scalar, or ``output.loss``) is the mean over the
  Z shares, i.e. the loss of the whole micro-batch on every rank (a Hugging Face
  ``num_items_in_batch``, the item count of the whole step, is divided by G_z for the
  share, so the loss stays the sum over the step's items / that count). Logits hold this
  rank's Z share of the rows and its X block of the vocabulary.

No full model per rank: ``model`` may come from
:func:`ds_ext.pmm.build_on_meta` (parameters on the meta device, each with its recorded
initialisation or checkpoint tensor); then each module's full serial parameters are
materialised while it is converted and dropped once its shards are cut, so a rank holds its
shards plus about one parameter (:mod:`ds_ext.pmm.meta`), with the values of slicing the
serial model.

Everything is checked before anything is converted: a module with parameters that no rule
converts, a grid that does not divide a layer, a head count, nonzero dropout, or a meta
parameter / buffer with nothing to materialise it from raise one line naming the layer or
the config key.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ds_ext.comm.mappings import mean_over
from ds_ext.errors import DsExtConfigError
from ds_ext.pmm.config import KEY
from ds_ext.pmm.engine import PMMEngine
from ds_ext.pmm.layers import LayerNorm, RMSNorm
from ds_ext.pmm.layout import LinearLayout
from ds_ext.pmm.linear import Linear
from ds_ext.pmm.meta import serial_values
from ds_ext.pmm.plans import ConversionError, Plan, plan_for
from ds_ext.pmm.vocab import Embedding, causal_lm_loss, tied_head

CONVERTED = (Linear, LayerNorm, RMSNorm)


def _is_rmsnorm(m: nn.Module) -> bool:
    return type(m).__name__.endswith("RMSNorm") and isinstance(getattr(m, "weight", None), nn.Parameter)


def _grid(engine: PMMEngine) -> str:
    return f"x={engine.x.size}, y={engine.y.size}, z={engine.z.size}"


def _check_meta(model: nn.Module) -> None:
    """A meta-device model must come from :func:`ds_ext.pmm.build_on_meta` (values to materialise, real buffers)."""
    hint = "build it with ds_ext.pmm.build_on_meta(lambda: Model(...)[, checkpoint=PATH])"
    for name, b in model.named_buffers():
        if b.is_meta:
            raise ConversionError(
                f"ds_ext.pmm.parallelize: buffer {name} is on the meta device; {hint} (buffers stay real)"
            )
    for name, p in model.named_parameters():
        if p.is_meta and getattr(p, "pmm_init", None) is None:
            raise ConversionError(
                f"ds_ext.pmm.parallelize: parameter {name} is on the meta device with no recorded "
                f"initialisation or checkpoint tensor; {hint}"
            )


def _check(model: nn.Module, plan: Plan, engine: PMMEngine, vocab_parallel: bool) -> None:
    _check_meta(model)
    gx, gy = engine.x.size, engine.y.size
    for key, value in plan.dropout.items():
        if value:
            raise ConversionError(
                f"ds_ext.pmm.parallelize: {plan.family} {key}={value}; 3D-PMM needs 0 "
                "(replicated ranks would draw different dropout masks)"
            )
    for key, heads in plan.heads.items():
        if heads % gx:
            allowed = ", ".join(str(d) for d in range(1, heads + 1) if heads % d == 0)
            raise ConversionError(
                f"{KEY}.grid.x={gx} does not divide the {heads} attention heads "
                f"({plan.family} {key}); allowed x: {allowed}"
            )
    for name, m in model.named_modules():
        last = name.rsplit(".", 1)[-1]
        if isinstance(m, nn.Embedding) or (isinstance(m, nn.Linear) and name == plan.head):
            rows, features = m.weight.shape
            try:
                LinearLayout(rows, features, gx if vocab_parallel else 1, 0, gy, 0, engine.z.size, 0)
            except ValueError as err:
                placed = "vocabulary-parallel table {} (rows over x, " if vocab_parallel else "table {} ("
                raise ConversionError(
                    f"{KEY}.grid ({_grid(engine)}) does not fit the {placed.format(name)}features over y, z chunks): {err}"
                ) from None
        elif isinstance(m, nn.Linear) and last in plan.linears:
            style = plan.linears[last]
            out_ax, in_ax = (engine.y, engine.x) if style.transposed else (engine.x, engine.y)
            try:
                LinearLayout(
                    m.out_features, m.in_features, out_ax.size, 0, in_ax.size, 0, engine.z.size, 0, style.out_chunks
                )
            except ValueError as err:
                raise ConversionError(f"{KEY}.grid ({_grid(engine)}) does not fit layer {name}: {err}") from None
        elif isinstance(m, nn.LayerNorm) or _is_rmsnorm(m):
            features = m.weight.shape[-1] if m.weight is not None else m.normalized_shape[0]
            if features % gy:
                raise ConversionError(f"{KEY}.grid.y={gy} does not divide {name}'s {features} hidden features")
        elif any(True for _ in m.parameters(recurse=False)):
            named = ", ".join(plan.linears)
            raise ConversionError(
                f"ds_ext.pmm.parallelize: cannot convert {name} ({type(m).__name__}); convertible: nn.Linear named "
                f"{named}{f' or the head {plan.head}' if plan.head else ''}, nn.Embedding, nn.LayerNorm, *RMSNorm"
            )


def _convert(
    name: str, m: nn.Module, plan: Plan, engine: PMMEngine, tables: dict[int, Embedding], vocab_parallel: bool
) -> nn.Module | None:
    """``m``'s converted form, its shards sliced from its full serial parameters; a module built
    on the meta device gets them one module at a time (:func:`ds_ext.pmm.meta.serial_values`)."""
    weight_id = id(m._parameters.get("weight"))  # the table's key, before serial_values swaps it
    if isinstance(m, nn.Linear) and name == plan.head:
        if m.bias is not None:
            raise ConversionError(f"ds_ext.pmm.parallelize: {name}: an LM head with a bias is not supported")
        if weight_id in tables:
            return tied_head(tables[weight_id], name)
    with serial_values(m, name):
        if isinstance(m, nn.Linear) and name == plan.head:
            return Linear.from_serial(m, engine, name=name, split_out=vocab_parallel)
        if isinstance(m, nn.Linear):
            style = plan.linears[name.rsplit(".", 1)[-1]]
            return Linear.from_serial(m, engine, transposed=style.transposed, out_chunks=style.out_chunks, name=name)
        if isinstance(m, nn.Embedding):
            tables[weight_id] = Embedding.from_embedding(m, engine, name=name, vocab_parallel=vocab_parallel)
            return tables[weight_id]
        if isinstance(m, nn.LayerNorm):
            return LayerNorm(m, engine, name=name)
        if _is_rmsnorm(m):
            return RMSNorm(m, engine, name=name)
    return None


class _BatchHooks:
    """Root forward hooks: keep the Z share of the batch; the loss becomes the Z mean; the
    engine's per-pass state (ORS gate over the weights, the bucket of Z-replicated parameters)."""

    def __init__(self, engine: PMMEngine, weights: list[nn.Parameter], replicated: list[nn.Parameter]) -> None:
        self.engine, self.weights, self.replicated = engine, weights, replicated

    def _slice(self, t: Any, batch: int) -> Any:
        if not (torch.is_tensor(t) and t.dim() >= 1 and t.shape[0] == batch):
            return t
        z = self.engine.z
        share = batch // z.size
        return t.narrow(0, z.rank * share, share)

    def pre(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        first = next((t for t in (*args, *kwargs.values()) if torch.is_tensor(t) and t.dim() >= 1), None)
        if first is not None and self.engine.z.size > 1:
            batch = first.shape[0]
            if batch % self.engine.z.size:
                raise DsExtConfigError(
                    f"{KEY}.grid.z={self.engine.z.size} does not divide the micro-batch of "
                    f"{batch} samples (train_micro_batch_size_per_gpu): every Z rank takes an "
                    "equal share"
                )
            args = tuple(self._slice(a, batch) for a in args)
            kwargs = {k: self._slice(v, batch) for k, v in kwargs.items()}
            if kwargs.get("num_items_in_batch") is not None:
                # Hugging Face divides the loss sum by the step's item count; this rank sums
                # over its Z share only and post() takes the Z mean, so each share counts 1 / G_z
                kwargs["num_items_in_batch"] = kwargs["num_items_in_batch"] / self.engine.z.size
        self.engine.begin_forward(self.weights, self.replicated)
        return args, kwargs

    def post(self, module: nn.Module, args: tuple, kwargs: dict, out: Any) -> Any:
        self.engine.end_forward()
        if torch.is_tensor(out) and out.dim() == 0:
            return mean_over(out, self.engine.comm, self.engine.z.group)
        if getattr(out, "loss", None) is not None:
            out.loss = mean_over(out.loss, self.engine.comm, self.engine.z.group)
        return out


def parallelize(
    model: nn.Module, engine: PMMEngine, plan: Plan | None = None, vocab_parallel: bool = True
) -> nn.Module:
    """Convert ``model`` (serial, or built by :func:`ds_ext.pmm.build_on_meta`) in place to the
    3D-PMM layout of ``engine``'s grid (001 §5.1.1, 000 §V); returns it. ``vocab_parallel``
    False: embedding tables and the LM head replicated over X (``ds_ext.pmm.vocab``)."""
    plan = plan or plan_for(model)
    _check(model, plan, engine, vocab_parallel)
    tables: dict[int, Embedding] = {}
    children = [
        (f"{pn}.{cn}" if pn else cn, parent, cn, child)
        for pn, parent in model.named_modules()
        for cn, child in parent.named_children()
    ]
    # tables first: a tied head (Hugging Face's tie_word_embeddings) may come earlier in
    # named_modules() order than its embedding, and must share the converted table
    children.sort(key=lambda c: not isinstance(c[3], nn.Embedding))
    for name, parent, child_name, child in children:
        new = _convert(name, child, plan, engine, tables, vocab_parallel)
        if new is not None:
            setattr(parent, child_name, new)
    if plan.adapt is not None:
        plan.adapt(model, engine)
    if plan.head is not None:
        head = model.get_submodule(plan.head)
        model._loss_function = causal_lm_loss(engine, head.out_axis)  # Hugging Face's loss_function reads it
    weights = list({id(m.weight): m.weight for m in model.modules() if isinstance(m, Linear)}.values())
    replicated = [p for p in model.parameters() if "z" in getattr(p, "pmm_replicated_over", ())]
    hooks = _BatchHooks(engine, weights, replicated)
    model.register_forward_pre_hook(hooks.pre, with_kwargs=True)
    model.register_forward_hook(hooks.post, with_kwargs=True)
    model.pmm_engine = engine
    return model


def local_shards(model: nn.Module, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's part of every parameter, cut from a serial model's tensors of the same names."""
    out = {}
    for mod_name, m in model.named_modules():
        for p_name, _ in m.named_parameters(recurse=False):
            name = f"{mod_name}.{p_name}" if mod_name else p_name
            if name not in full:
                continue
            out[name] = m.shard_full(p_name, full[name]) if isinstance(m, CONVERTED) else full[name]
    return out
