"""The ``goldfish`` plugin: the Goldfish loss from the ds_config (000 §VIII-D; Hans et al., arXiv
2406.10209).

``"ds_ext": {"goldfish": {"enabled": true, "k": 2, "h": 13}}`` leaves out of the training loss every
token the hashed mask of :mod:`ds_ext.goldfish.mask` drops (a function of the ``h`` tokens before
it, 1 in ``k`` on average); the loss is the mean over the tokens kept. The mask is computed once per
micro-batch from the token ids, so it is the same on every rank that sees the same tokens (tensor,
pipeline, data) and in every epoch. Where it is applied, with the script unchanged:

* ds_ext's :class:`~ds_ext.models.GPT` and :class:`~ds_ext.models.gpt_moe.GPTMoE`
  (``examples/train.py``): the model's ``loss_mask``, so ``engine(tokens)`` is the masked mean;
  under 3D-PMM (:class:`ds_ext.pmm.gpt.PMMGPT`) the dropped targets enter the vocabulary-parallel
  cross-entropy as its ignore index, before its reductions over the vocabulary axis;
* a Hugging Face causal LM (``engine(input_ids=..., labels=...)``, the ``Trainer``): a forward
  pre-hook sets the dropped ``labels`` to -100, the model's own ignore index, before its loss. The
  model then divides by the labels it keeps; under the ``Trainer``, whose ``num_items_in_batch`` is
  counted from the batch before the forward, it divides by that count instead (every labelled token
  of the optimizer step, dropped ones included). Under 3D-PMM the hook runs after the one that
  takes the rank's Z share of the rows, and the converted loss ignores the same index;
* ds_ext's pipeline GPT (:func:`ds_ext.models.gpt_pipe.gpt_pipeline`) and GPT-NeoX's
  ``GPT2ModelPipe`` (``pipe_parallel_size >= 1``, unmodified) on DeepSpeed's PipelineEngine: the
  ``loss_fn`` on the last stage masks the labels, or multiplies GPT-NeoX's own ``loss_mask``
  (:class:`MaskedLabelsLoss`);
* GPT-NeoX's plain model (``pipe_parallel_size: 0``), whose loss its training loop computes outside
  the model: the ``cross_entropy`` of its ``megatron/training.py`` multiplies its ``loss_mask`` the
  same way (:class:`MaskedLabelsLoss`, rebound in the client's module while the engine lives);
* Megatron-DeepSpeed's ``pretrain_gpt.py``, both paths (``GPTModel`` with ``--no-pipeline-parallel``,
  ``GPTModelPipe`` on the PipelineEngine): the ``get_ltor_masks_and_position_ids`` its batch
  functions build ``loss_mask`` with returns it multiplied by the mask of the next tokens
  (:class:`NextTokensLossMask`), from the whole sequence on every tensor rank, before Megatron's
  vocabulary-parallel cross-entropy and the per-token weighting that follows it.

The client names rebound are :mod:`ds_ext.goldfish.client_loss`'s. With 3D-PMM's Z > 1 each Z
share of the micro-batch is averaged over its own kept tokens and the shares' losses averaged, as
data parallelism averages its ranks' losses. Anything else (another ``PipelineModule``, another
model, GPT-NeoX's ``train_impl`` other than ``normal``, a Megatron-DeepSpeed main script without
``pretrain_gpt.py``'s ``get_ltor_masks_and_position_ids``) is refused before any collective, in one
line naming ``ds_ext.goldfish``.
"""

from __future__ import annotations

from typing import Any

import torch

from ds_ext.errors import DsExtConfigError
from ds_ext.goldfish import client_loss
from ds_ext.goldfish.config import KEY, GoldfishConfig
from ds_ext.goldfish.mask import GoldfishMask, mask_labels
from ds_ext.models import GPT
from ds_ext.models.gpt_moe import GPTMoE
from ds_ext.models.gpt_pipe import LMLoss
from ds_ext.plugin import Plugin

SUPPORTED = (
    "ds_ext.models.GPT, ds_ext.models.gpt_moe.GPTMoE, ds_ext.models.gpt_pipe.gpt_pipeline's PipelineModule, "
    "GPT-NeoX's GPT2ModelPipe (pipe_parallel_size >= 1) and plain model (pipe_parallel_size 0), "
    "Megatron-DeepSpeed's GPTModel and GPTModelPipe (pretrain_gpt.py), "
    "a Hugging Face causal LM (AutoModelForCausalLM's classes)"
)


def _pipeline_loss(model: Any) -> bool:
    """A PipelineModule whose last stage's ``loss_fn(output, labels)`` takes the next tokens as
    ``labels``: ds_ext's :class:`~ds_ext.models.gpt_pipe.LMLoss`, or GPT-NeoX's
    ``partial(megatron.model.gpt2_model.cross_entropy, ...)`` on ``(labels, loss_mask)``."""
    fn = getattr(model, "loss_fn", None)
    func = getattr(fn, "func", None)  # functools.partial
    neox = getattr(func, "__module__", None) == "megatron.model.gpt2_model" and func.__name__ == "cross_entropy"
    return isinstance(fn, LMLoss) or neox


def _is_causal_lm(model: Any) -> bool:
    """A Hugging Face causal LM: its labels are its input ids, shifted by its own loss."""
    if not any(
        c.__module__ == "transformers.modeling_utils" and c.__name__ == "PreTrainedModel" for c in type(model).__mro__
    ):
        return False
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return type(model).__name__ in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()


class GoldfishPlugin(Plugin):
    """Installs the Goldfish mask on the model's loss (module docstring)."""

    name = "goldfish"
    Config = GoldfishConfig

    mask: GoldfishMask
    # a client whose training code weighs the loss: (client, its module, the name rebound there)
    site: tuple[str, Any, str] | None = None

    def check(self, model: Any) -> None:
        """Find where the model's loss is computed (a client's loss site, ds_ext's GPT, a PipelineModule's
        ``loss_fn``, a Hugging Face causal LM); refuse any other model."""
        client = client_loss.client_model(model)
        if client is not None:
            args = self.runtime.initialize_kwargs.get("args") if self.runtime is not None else None
            self.site = (client, *client_loss.loss_site(client, KEY, args))
            return
        ours = type(model) in (GPT, GPTMoE) or _pipeline_loss(model)
        if not ours and not _is_causal_lm(model):
            raise DsExtConfigError(
                f"{KEY}: the loss of a {type(model).__module__}.{type(model).__name__} is not masked; allowed models: "
                f"{SUPPORTED}"
            )

    def prepare(self, model: Any, optimizer: Any, ds_config: dict) -> tuple[Any, Any, dict]:
        """Build the Goldfish mask (000 §VIII-A) and put it on the model's loss (a client's loss: in
        :meth:`attach`)."""
        self.mask = GoldfishMask(self.config.k, self.config.h)
        if self.site is not None:  # rebound in attach, once the engine that restores it exists
            return model, optimizer, ds_config
        if isinstance(model, (GPT, GPTMoE)):
            model.loss_mask = self.mask
        elif _pipeline_loss(model):
            model.loss_fn = MaskedLabelsLoss(model.loss_fn, self.mask)
        else:
            model.register_forward_pre_hook(self._mask_labels, with_kwargs=True)
        return model, optimizer, ds_config

    def attach(self, engine: Any) -> None:
        """Rebind a client's loss to the masked one, restored when the engine is destroyed."""
        if self.site is None:
            return
        client, module, name = self.site
        wrap = NextTokensLossMask if client == client_loss.MEGATRON_DEEPSPEED else MaskedLabelsLoss
        restore = client_loss.rebind(module, name, lambda fn: wrap(fn, self.mask))
        from ds_ext.integration import ds_engine  # DeepSpeed is imported on use

        ds_engine.restore_on_destroy(engine, restore)

    def _mask_labels(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Hugging Face forward pre-hook: the dropped ``labels`` become the ignore index."""
        labels = kwargs.get("labels")
        if labels is None:
            return args, kwargs
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if input_ids is None or input_ids.shape != labels.shape:
            raise DsExtConfigError(
                f"{KEY}: the mask is computed from input_ids, which must come with labels of their shape "
                f"(got {None if input_ids is None else tuple(input_ids.shape)} and {tuple(labels.shape)})"
            )
        return args, {**kwargs, "labels": mask_labels(labels, self.mask(input_ids))}


class MaskedLabelsLoss(client_loss.Rebound):
    """A loss ``fn(output, labels, **kw)`` with the Goldfish-dropped labels left out (picklable, as the
    PipelineModule is): labels set to -100 (ds_ext's ``LMLoss``), or, for ``(labels, loss_mask)``
    (GPT-NeoX's ``cross_entropy``, its pipeline's ``loss_fn`` and its plain loop's), the client's
    own ``loss_mask`` multiplied by the mask, so its loss divides by the tokens kept. Only the labels
    ``x_1 .. x_L`` are at hand (a pipeline's last stage holds nothing else), so the context of label
    ``x_i`` is read from the labels: the first token with a whole context, ``x_h``, whose context
    starts at ``x_0``, is always kept there; every later token as :func:`goldfish_keep` decides."""

    def __init__(self, loss_fn: Any, mask: GoldfishMask) -> None:
        self.wrapped, self.mask = loss_fn, mask

    def __call__(self, output: torch.Tensor, labels: Any, **kwargs: Any) -> torch.Tensor:
        if isinstance(labels, (tuple, list)):
            ids, loss_mask, *rest = labels
            keep = self.mask(ids).to(loss_mask.dtype)
            return self.wrapped(output, (ids, loss_mask * keep, *rest), **kwargs)
        return self.wrapped(output, mask_labels(labels, self.mask(labels)), **kwargs)


class NextTokensLossMask(client_loss.Rebound):
    """Megatron-DeepSpeed's ``get_ltor_masks_and_position_ids(data, ...)`` whose ``loss_mask`` comes
    back multiplied by the Goldfish mask of the next tokens. Its batch functions pass the tokens
    ``x_0 .. x_{L-1}`` and weigh the label ``x_{j+1}`` by column ``j``; that label's context
    ``x_{j+1-h} .. x_j`` lies in ``data``, so every label is masked as in the whole sequence
    (``x_h`` included), from the same tokens on every tensor rank."""

    def __init__(self, fn: Any, mask: GoldfishMask) -> None:
        self.wrapped, self.mask = fn, mask

    def __call__(self, data: torch.Tensor, *args: Any, **kwargs: Any) -> tuple:
        attention_mask, loss_mask, position_ids = self.wrapped(data, *args, **kwargs)
        # the sequence x_0 .. x_L with a stand-in for x_L, which is in no context
        keep = self.mask(torch.cat([data, data[..., -1:]], dim=-1))[..., 1:]
        return attention_mask, loss_mask * keep.to(loss_mask.dtype), position_ids
