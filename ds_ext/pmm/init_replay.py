"""Record a model's initialisation on the meta device; replay it one parameter at a time.

Building without the serial model in full (001 ch. 5, 000 §V: 4D parallelism exists so that no rank holds the whole
model). While a model is built under :class:`InitRecorder` (:func:`ds_ext.pmm.meta.build_on_meta`):

* every parameter moves to the meta device when it is registered (``nn.Module.register_parameter``);
  buffers stay real (rotary tables are computed as in the serial build);
* every ATen op that writes into a parameter's storage is appended to the parameter's
  :class:`InitLog` (the op, its scalar arguments and the geometry of the written view);
* an op that draws random numbers (ATen tag ``nondeterministic_seeded``) records its
  generator's state before it and, where it acts on meta tensors, runs once on a CPU
  stand-in of the same geometry (a scratch buffer), so the generator advances exactly as in
  the serial CPU build and every later draw sees the serial stream.

A log is cut at each op that overwrites the whole storage without reading it (``normal_``,
``uniform_``, ``fill_``, ``zero_``, ...): only the ops that decide the final value are kept.
:meth:`InitLog.full` replays them on a fresh CPU tensor with the recorded generator states:
the serial value bit for bit, one parameter's worth of memory. What cannot be replayed is
reported in one line: a value that depends on another tensor (``copy_`` from a computed
tensor), an op that reads a meta tensor's values, and the ``torch.nn.init`` functions that
return meta tensors untouched (:class:`NoInitSkips`).
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from ds_ext.errors import DsExtError

aten = torch.ops.aten
_TARGET = object()  # stands for the written tensor in a recorded op's arguments
_UNDEFINED = (aten.empty.memory_format, aten.empty_strided.default)  # creations whose values are garbage
_FILLS = (aten.fill_.Scalar, aten.zero_.default)
_IS_META = torch.Tensor.is_meta  # the property's descriptor


class MetaBuildError(DsExtError, RuntimeError):
    """A model that cannot be built on the meta device, or a parameter whose value cannot be replayed."""


def _dense(t: torch.Tensor) -> bool:
    """``t`` covers a block of ``t.numel()`` consecutive elements, each once (any dimension order)."""
    expected = 1
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride()) if s != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _generator_slot(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> tuple[Any, int | str | None]:
    """(the generator passed to ``func`` or None, where it was passed)."""
    for i, a in enumerate(func._schema.arguments):
        if a.name == "generator":
            if i < len(args):
                return args[i], (i if args[i] is not None else None)
            gen = kwargs.get("generator")
            return gen, ("generator" if gen is not None else None)
    return None, None


@dataclass
class _Op:
    """One recorded op: re-run on a CPU tensor (``target``) or, for a factory, creating it."""

    func: torch._ops.OpOverload
    args: tuple
    kwargs: dict
    rng: torch.Tensor | None  # the generator's state just before the op
    gen_slot: int | str | None  # where an explicit generator was passed (None: the default one)
    view: tuple[tuple[int, ...], tuple[int, ...], int] | None  # size, stride, storage offset written

    def run(self, target: torch.Tensor | None) -> torch.Tensor:
        put = lambda a: target if a is _TARGET else a  # noqa: E731
        args, kwargs = tree_map(put, self.args), tree_map(put, self.kwargs)
        if kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "meta":
            kwargs["device"] = torch.device("cpu")
        if self.rng is None:
            return self.func(*args, **kwargs)
        if self.gen_slot is not None:
            gen = torch.Generator()
            gen.set_state(self.rng)
            if isinstance(self.gen_slot, int):
                args = (*args[: self.gen_slot], gen, *args[self.gen_slot + 1 :])
            else:
                kwargs[self.gen_slot] = gen
            return self.func(*args, **kwargs)
        saved = torch.get_rng_state()
        torch.set_rng_state(self.rng)
        try:
            return self.func(*args, **kwargs)
        finally:
            torch.set_rng_state(saved)


@dataclass
class InitLog:
    """How one parameter's storage got its values (see the module docstring)."""

    numel: int  # elements of the storage
    dtype: torch.dtype
    ops: list[_Op] = field(default_factory=list)
    defined: bool = True  # False after a creation with garbage values (torch.empty) not yet overwritten
    why: str | None = None  # why the value cannot be replayed, if it cannot
    shape: tuple[int, ...] | None = None  # the parameter's size and stride, set on registration
    stride: tuple[int, ...] | None = None

    def write(self, op: _Op, overwrites: bool) -> None:
        if overwrites:
            self.ops, self.defined, self.why = [op], True, None
        else:
            self.ops.append(op)

    def full(self, name: str) -> torch.Tensor:
        """The parameter's serial value (CPU), replayed from the log."""
        if self.why is not None:
            raise MetaBuildError(
                f"ds_ext.pmm.build_on_meta: the initial value of {name} cannot be replayed: {self.why}"
            )
        if not self.defined:
            raise MetaBuildError(
                f"ds_ext.pmm.build_on_meta: {name} is never initialised (created by torch.empty and "
                "never overwritten), so it has no serial value to shard"
            )
        base = None
        for op in self.ops:
            if op.view is None:  # the creating factory
                made = op.run(None)
                base = made.as_strided((self.numel,), (1,), 0)
                continue
            if base is None:
                base = torch.empty(self.numel, dtype=self.dtype)
            op.run(base.as_strided(*op.view))
        return base.as_strided(self.shape, self.stride, 0)


class NoInitSkips(TorchFunctionMode):
    """``torch.nn.init``'s ``trunc_normal_``, ``orthogonal_``, ``dirac_`` and ``sparse_`` return a
    meta tensor untouched (``if tensor.is_meta: return tensor``): recorded, that would keep the
    previous init's values and skip the serial build's draws. Their ``is_meta`` question on a
    meta tensor is answered with one line naming the function instead."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__self__", None) is _IS_META and args[0].is_meta:
            caller = sys._getframe(1)
            if caller.f_globals.get("__name__") == "torch.nn.init":
                init = caller.f_code.co_name.removeprefix("_no_grad_")
                raise MetaBuildError(
                    f"ds_ext.pmm.build_on_meta: torch.nn.init.{init} skips meta tensors, so its "
                    "values (and its random draws) cannot be recorded; build the model normally, "
                    "or from a checkpoint"
                )
        return func(*args, **(kwargs or {}))


class InitRecorder(TorchDispatchMode):
    """The dispatch mode of :func:`ds_ext.pmm.meta.build_on_meta` (see the module docstring).

    ``record=False`` (a build whose values come from a checkpoint): parameters still move to the
    meta device, but nothing is logged and the generator is not advanced."""

    def __init__(self, record: bool = True) -> None:
        super().__init__()
        self.record = record
        self._logs: dict[int, tuple[weakref.ref, InitLog]] = {}  # by storage, while it lives
        self._scratch: torch.UntypedStorage | None = None  # random ops' stand-ins (_advance)

    # ---- storages and their logs ---------------------------------------------------------
    def log_of(self, t: torch.Tensor) -> InitLog | None:
        storage = t.untyped_storage()
        entry = self._logs.get(storage._cdata)
        return entry[1] if entry is not None and entry[0]() is storage else None

    def _track(self, t: torch.Tensor, log: InitLog) -> None:
        storage = t.untyped_storage()
        self._logs[storage._cdata] = (weakref.ref(storage), log)

    def _new_log(self, t: torch.Tensor, **kw: Any) -> InitLog:
        return InitLog(t.untyped_storage().nbytes() // t.element_size(), t.dtype, **kw)

    # ---- parameters move to meta on registration -----------------------------------------
    def to_meta(self, module: nn.Module, name: str, param: nn.Parameter) -> nn.Parameter:
        where = f"{type(module).__name__}.{name}"
        if type(param) is not nn.Parameter:
            raise MetaBuildError(f"ds_ext.pmm.build_on_meta: {where} is a {type(param).__name__}, not an nn.Parameter")
        log = None
        if self.record:
            log = self.log_of(param)
            if log is None:
                log = self._new_log(param, why="it was created outside build_on_meta or by an op ds_ext cannot see")
            elif log.shape is not None:
                raise MetaBuildError(
                    f"ds_ext.pmm.build_on_meta: {where} shares its storage with another parameter "
                    "(tie parameters by assigning the same nn.Parameter instead)"
                )
            whole = param.storage_offset() == 0 and param.numel() == log.numel and _dense(param)
            if not whole or param.dtype != log.dtype:
                log.why = f"{where} is a view into a larger tensor or of another dtype"
            log.shape, log.stride = tuple(param.shape), tuple(param.stride())
        meta = nn.Parameter(
            torch.empty_strided(param.shape, param.stride(), dtype=param.dtype, device="meta"),
            requires_grad=param.requires_grad,
        )
        meta.__dict__.update(param.__dict__)
        if log is not None:
            self._track(meta, log)
            meta.pmm_init = log
        return meta

    @contextlib.contextmanager
    def parameters_on_meta(self) -> Iterator[None]:
        original = nn.Module.register_parameter

        def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
            if param is not None and not param.is_meta:
                param = self.to_meta(module, name, param)
            original(module, name, param)

        nn.Module.register_parameter = register
        try:
            yield
        finally:
            nn.Module.register_parameter = original

    # ---- every op of the build -----------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        on_meta = any(t.is_meta for t in tensors) or str(kwargs.get("device")) == "meta"
        written = self._written(func, args, kwargs)
        random = torch.Tag.nondeterministic_seeded in func.tags
        state, gen_slot = None, None
        if self.record and random:
            gen, gen_slot = _generator_slot(func, args, kwargs)
            state = (gen or torch.default_generator).get_state()
            if on_meta:
                self._advance(func, args, kwargs)
        try:
            out = func(*args, **kwargs)
        except Exception as err:
            if not on_meta:
                raise
            raise MetaBuildError(
                f"ds_ext.pmm.build_on_meta: {func} cannot run on the meta device ({err}); the "
                "model's construction reads parameter values"
            ) from None
        if self.record:
            self._note(func, args, kwargs, tensors, written, out, state, gen_slot, random)
        return out

    @staticmethod
    def _written(func, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        out = []
        for i, a in enumerate(func._schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                value = args[i] if i < len(args) else kwargs.get(a.name)
                if isinstance(value, torch.Tensor):
                    out.append(value)
        return out

    def _advance(self, func, args: tuple, kwargs: dict) -> None:
        """Run a random op once on CPU stand-ins of its meta tensors: the serial build's draws. The
        first stand-in lives in one scratch buffer kept for the whole build (as large as the largest
        parameter drawn so far), so the build does not churn the allocator with parameter-sized blocks."""
        first = True

        def stand_in(t: Any) -> Any:
            nonlocal first
            if not (isinstance(t, torch.Tensor) and t.is_meta):
                return t
            if not first:
                return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
            first = False
            extent = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) if t.numel() else 0
            if self._scratch is None or self._scratch.nbytes() < extent * t.element_size():
                self._scratch = None
                self._scratch = torch.empty(extent * t.element_size(), dtype=torch.uint8).untyped_storage()
            return torch.empty(0, dtype=t.dtype).set_(self._scratch, 0, t.shape, t.stride())

        args, kwargs = tree_map(stand_in, args), tree_map(stand_in, kwargs)
        if str(kwargs.get("device")) == "meta":
            kwargs["device"] = torch.device("cpu")
        func(*args, **kwargs)

    def _note(self, func, args, kwargs, tensors, written, out, state, gen_slot, random) -> None:
        if written:
            for target in written:
                log = self.log_of(target)
                if log is None:
                    continue
                if any(t is not target for t in tensors):
                    log.why = f"{func} reads another tensor"
                    continue
                swap = lambda a: _TARGET if a is target else a  # noqa: E731
                view = (tuple(target.shape), tuple(target.stride()), target.storage_offset())
                op = _Op(func, tree_map(swap, args), tree_map(swap, kwargs), state, gen_slot, view)
                whole = target.storage_offset() == 0 and target.numel() == log.numel and _dense(target)
                log.write(op, overwrites=whole and (func in _FILLS or random))
            return
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        if not tensors and len(outs) == 1:  # a factory: its output is replayable from the call
            self._track(
                outs[0],
                self._new_log(
                    outs[0], ops=[_Op(func, args, dict(kwargs), state, gen_slot, None)], defined=func not in _UNDEFINED
                ),
            )
            return
        inputs = {t.untyped_storage()._cdata for t in tensors}
        for o in outs:
            if o.untyped_storage()._cdata not in inputs:  # a fresh storage computed from other tensors
                self._track(o, self._new_log(o, why=f"it is computed by {func} from other tensors"))
