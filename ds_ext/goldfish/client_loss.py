"""Where the Megatron-style clients weigh each token's loss outside their model: the names a plugin
rebinds, in the client's own module, to change which tokens the loss counts (``ds_ext.goldfish``).

Megatron-DeepSpeed and GPT-NeoX compute the training loss in their training code, not in the
module they hand ``deepspeed.initialize``, so a hook on the model cannot reach the ``loss_mask``
their loss divides by. Read in the pinned clients (../shared/clients/README.md):

* **Megatron-DeepSpeed** (``megatron.model.gpt_model``'s ``GPTModel`` with
  ``--no-pipeline-parallel``, ``GPTModelPipe`` on DeepSpeed's PipelineEngine by default):
  ``pretrain_gpt.py``'s ``get_batch`` and ``get_batch_pipe`` (the pipeline's batch function) build
  ``loss_mask`` with ``get_ltor_masks_and_position_ids(tokens, eod, ...)``, a name the script
  imports from ``megatron.utils`` (pretrain_gpt.py:16, 119, 192), from the whole sequence's tokens
  after ``tensor_parallel.broadcast_data`` (the same on every tensor rank) and before the script
  shards the sequence; ``loss_func`` (plain path) and ``CrossEntropy`` (``GPTModelPipe``) then take
  ``sum(losses * loss_mask) / loss_mask.sum()`` over the per-token losses of Megatron's
  vocabulary-parallel cross-entropy. The site is the main script's name (``sys.modules["__main__"]``,
  ``pretrain_gpt.py`` run by ``python``, ``torchrun``, ``deepspeed`` or ``python -m ds_ext.run``).
* **GPT-NeoX**, ``pipe_parallel_size: 0`` (``GPT2ModelPipe.to_sequential()``, a
  ``megatron.model.utils.SequentialWrapper``): ``forward_step`` in ``megatron/training.py`` computes
  ``cross_entropy(outputs, (labels, loss_mask), _fp16=...)`` (training.py:597) for
  ``train_impl: normal``, a name ``megatron.training`` imports from ``megatron.model.gpt2_model``
  (training.py:66). Its other ``train_impl`` values compute their own losses.

No DeepSpeed name is touched here (so no :mod:`ds_version` gate); each client name is checked
where it is found: present, the call shape read above, not already rebound by another engine.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from types import ModuleType
from typing import Any, Callable

from ds_ext.errors import DsExtConfigError

MEGATRON_DEEPSPEED = "Megatron-DeepSpeed"
GPT_NEOX = "GPT-NeoX"
# (module, name) of each client's loss-mask site, and the leading parameters its call shape has
_MDS_NAME = "get_ltor_masks_and_position_ids"
_MDS_PARAMS = ("data", "eod_token", "reset_position_ids", "reset_attention_mask", "eod_mask_loss")
_NEOX_MODULE, _NEOX_NAME, _NEOX_PARAMS = "megatron.training", "cross_entropy", ("output", "labels")


def client_model(model: Any) -> str | None:
    """:data:`MEGATRON_DEEPSPEED` for its ``GPTModel`` / ``GPTModelPipe``, :data:`GPT_NEOX` for its
    plain model (``pipe_parallel_size: 0``), else None."""
    cls = type(model)
    if cls.__module__ == "megatron.model.gpt_model" and cls.__name__ in ("GPTModel", "GPTModelPipe"):
        return MEGATRON_DEEPSPEED
    if (
        cls.__module__ == "megatron.model.utils"
        and cls.__name__ == "SequentialWrapper"
        and getattr(model, "parent_class_name", None) == "GPT2ModelPipe"
    ):
        return GPT_NEOX
    return None


class Rebound:
    """Marks a function a plugin put in a client's module (so a second engine does not wrap it again)."""

    wrapped: Callable


def loss_site(client: str, owner: str, args: Any = None) -> tuple[ModuleType, str]:
    """(the client's module, the name in it) where ``client``'s loss mask is built or applied (module
    docstring); raises one line naming ``owner`` (the plugin's key) where the site is not the one read
    in the client. ``args``: what the client passed ``deepspeed.initialize`` (GPT-NeoX's
    ``NeoXArgs``: its ``train_impl`` must be ``normal``)."""
    if client == MEGATRON_DEEPSPEED:
        module = sys.modules.get("__main__")
        where = f"the main script ({getattr(module, '__file__', None)})"
        name, params, shape = _MDS_NAME, _MDS_PARAMS, "pretrain_gpt.py run as the main script"
    else:
        impl = getattr(args, "train_impl", "normal")
        if impl != "normal":
            raise DsExtConfigError(
                f"{owner}: GPT-NeoX's train_impl {impl!r} computes its own loss, not cross_entropy over loss_mask; "
                "allowed: train_impl 'normal'"
            )
        module = importlib.import_module(_NEOX_MODULE)
        where, name, params, shape = _NEOX_MODULE, _NEOX_NAME, _NEOX_PARAMS, "GPT-NeoX's megatron/training.py"
    fn = getattr(module, name, None)
    if isinstance(fn, Rebound):
        raise DsExtConfigError(f"{owner}: {where}'s {name} is already rebound by another engine; allowed: one engine")
    if not callable(fn) or tuple(inspect.signature(fn).parameters)[: len(params)] != params:
        raise DsExtConfigError(
            f"{owner}: {client}'s loss_mask is built by {name}({', '.join(params)}, ...), which {where} does not "
            f"have; allowed: {shape}"
        )
    return module, name


def rebind(module: ModuleType, name: str, wrap: Callable[[Callable], Rebound]) -> Callable[[], None]:
    """Replace ``module.name`` by ``wrap(module.name)``; return the function that puts it back while
    it is still the one put there (``engine.destroy()`` runs again from DeepSpeed's ``__del__``, at
    garbage collection: it must not undo what was bound since)."""
    before = getattr(module, name)
    rebound = wrap(before)
    setattr(module, name, rebound)

    def restore() -> None:
        if getattr(module, name, None) is rebound:
            setattr(module, name, before)

    return restore
