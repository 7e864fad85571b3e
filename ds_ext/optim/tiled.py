"""The tiled mixed-precision Adam/AdamW step (001 §7.2).

Notation (001 §7.2): ``ts`` = tile size in parameters; θ32 = fp32 master weights,
m, v = Adam moments, ∇θ16 = 16-bit (or fp32) gradients, s = loss scale, c = clip
coefficient.

The untiled mixed-precision step up-casts a whole partition of ∇θ16 to fp32 at once
and then runs the torch optimizer on it, whose own temporaries (``denom``) are again
partition-sized: the memory spike grows with the number of local (expert) parameters.
The tiled step visits every fp32 master tensor in tiles of at most ``ts`` elements and,
for each tile, through ONE reused fp32 buffer of ``ts`` elements (4 x ts bytes):

1. up-cast: ``buf <- ∇θ16[tile]`` (the caller's ``load`` writes fp32 into ``buf``);
2. unscale and clip: ``buf <- buf / s * c`` (the caller's ``load`` does it with the same
   kernel and scalars as the untiled path, so the values are bit-identical);
3. update: Adam on the slices ``θ32[tile], m[tile], v[tile]``; the denominator
   ``sqrt(v)/sqrt(1-β2^t) + eps`` is written into ``buf`` once the gradient in it has been
   consumed, so the update allocates nothing tile-sized;
4. copy back: the caller's ``store`` writes ``θ32[tile]`` into the 16-bit weights.

The global gradient norm and the fp16 overflow flag are the caller's business and must
be decided *before* the first tile is updated (a skipped step leaves every tile
untouched); the step counter is incremented once per step, not per tile.

Bit-identity. Adam is elementwise, so applying torch's single-tensor Adam arithmetic
(``torch.optim.adam._single_tensor_adam``, torch 2.13: ``lerp_`` for m, ``mul_``/
``addcmul_`` for v, ``(sqrt(v) / sqrt(bc2)).add_(eps)``, ``addcdiv_``) to slices gives the
same bits as applying it to the whole tensor. The reference is torch's
``for-loop`` implementation (``foreach=False``), which is also what ``foreach=None`` (the
default) picks for CPU tensors; ``foreach=True`` (``_multi_tensor_adam``) was checked to give
the same bits on CPU as well (tests/test_tiled_optimizer.py). ``fused=True`` groups run
torch's fused kernel itself on each tile (its arithmetic differs from the for-loop's), with
tiles of whole cache lines; ``capturable`` and ``differentiable`` are refused
(:func:`check_tileable`). DeepSpeed's ``FusedAdam`` (what a ds_config ``"Adam"`` builds, and
what Megatron-DeepSpeed and GPT-NeoX use) runs its own kernel on each tile, with its group
step rule (:mod:`ds_ext.integration.ds_fused_adam`), also on tiles of whole cache lines.
"""

from __future__ import annotations

import bisect
import itertools
from typing import Any, Callable

import torch

from ds_ext.errors import DsExtConfigError
from ds_ext.integration import ds_fused_adam

KEY = "ds_ext.tiled_optimizer"
TILEABLE: tuple[type[torch.optim.Optimizer], ...] = (torch.optim.Adam, torch.optim.AdamW)
ALLOWED_TYPES = "torch.optim.Adam, torch.optim.AdamW, deepspeed.ops.adam.FusedAdam"

# fill(buf, start): write the fp32, unscaled and clipped gradient of elements
# [start, start + buf.numel()) of the master tensor into ``buf``.
LoadTile = Callable[[torch.Tensor, int], None]
# store(start, end): the master slice [start, end) is final; copy it where it belongs.
StoreTile = Callable[[int, int], None]
# keep(t): a newly created optimizer state tensor -> the tensor the state holds (where it lives)
KeepState = Callable[[torch.Tensor], torch.Tensor]


FUSED_TILE_MULTIPLE = 16  # fp32 elements per 64-byte cache line: the CPU fused kernel's work unit


def refuse_closure(closure: Callable[[], Any] | None) -> None:
    """The tiled step takes no closure: the loss and gradients exist before it, as in DeepSpeed's steps."""
    if closure is not None:
        raise DsExtConfigError(f"{KEY}: step(closure) is not supported; call step() after backward")


def check_tileable(optimizer: Any, tile_size: int | None = None) -> None:
    """Raise :class:`DsExtConfigError` unless ``optimizer`` is a torch Adam/AdamW we tile
    bit-identically (001 §7.2). ``fused=True`` groups need whole cache lines per tile:
    torch's CPU fused kernel vectorises whole cache lines and does a partial one scalar
    (DeepSpeed's FusedAdam on CPU too)."""
    ds_fused = ds_fused_adam.is_fused_adam(optimizer)
    if not isinstance(optimizer, TILEABLE) and not ds_fused:
        raise DsExtConfigError(
            f"{KEY}: optimizer type {type(optimizer).__module__}.{type(optimizer).__qualname__} "
            f"is not tiled; allowed types: {ALLOWED_TYPES}"
        )
    for i, g in enumerate(optimizer.param_groups):
        bad = [k for k in ("capturable", "differentiable") if g.get(k)]
        if bad:
            raise DsExtConfigError(
                f"{KEY}: param group {i} sets {', '.join(f'{k}=True' for k in bad)}; the tiled step "
                "reproduces torch's single-tensor and fused Adam: allowed capturable=False, differentiable=False"
            )
        if (g.get("fused") or ds_fused) and tile_size is not None and tile_size % FUSED_TILE_MULTIPLE:
            raise DsExtConfigError(
                f"{KEY}.tile_size: param group {i} is fused (fused=True or FusedAdam), whose tiles must be whole 64-byte cache lines to "
                f"give the fused kernel's bits; allowed: a multiple of {FUSED_TILE_MULTIPLE} (got {tile_size})"
            )
        for k in ("lr", "eps", "weight_decay"):
            if isinstance(g.get(k), torch.Tensor):
                raise DsExtConfigError(f"{KEY}: param group {i} has a Tensor '{k}'; allowed: a Python float")
        if any(isinstance(b, torch.Tensor) for b in g["betas"]):
            raise DsExtConfigError(f"{KEY}: param group {i} has Tensor betas; allowed: Python floats")


class TileBuffer:
    """The one reused fp32 buffer of ``tile_size`` elements (4 x tile_size bytes).

    Allocated by a step's first tile, reused by all its tiles (001 §7.2: "the temporary
    memory ... can be reused across tiles") and released when the step ends
    (:meth:`release`), so it is part of the step's spike and of nothing else.
    """

    def __init__(self, tile_size: int) -> None:
        if not isinstance(tile_size, int) or isinstance(tile_size, bool) or tile_size <= 0:
            raise DsExtConfigError(f"{KEY}.tile_size: must be a positive integer (got {tile_size!r})")
        self.tile_size = tile_size
        self._buf: torch.Tensor | None = None
        self.tiles_processed = 0
        self.allocations = 0

    def release(self) -> None:
        self._buf = None

    def view(self, n: int, device: torch.device | None = None) -> torch.Tensor:
        """The first ``n`` <= tile_size elements of the buffer (allocated on ``device``)."""
        if n > self.tile_size:
            raise ValueError(f"tile of {n} elements exceeds tile_size {self.tile_size}")
        if self._buf is None:
            self._buf = torch.empty(self.tile_size, dtype=torch.float32, device=device)
            self.allocations += 1
        return self._buf[:n]

    @property
    def nbytes(self) -> int:
        """Bytes held now (4 x tile_size during a step, 0 between steps)."""
        return 0 if self._buf is None else self._buf.numel() * self._buf.element_size()


def _adam_state(optimizer: torch.optim.Optimizer, p: torch.Tensor, amsgrad: bool, fused: bool, keep: KeepState) -> dict:
    """The optimizer's state of ``p``, created exactly as torch's Adam does lazily
    (``Adam._init_group``: a fused step counter lives on the parameter's device); each new
    tensor passes through ``keep`` (optimizer offload takes it in custody)."""
    state = optimizer.state[p]
    if len(state) == 0:
        if fused:
            state["step"] = keep(torch.zeros((), dtype=torch.float32, device=p.device))
        else:
            scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
            state["step"] = keep(torch.tensor(0.0, dtype=scalar))
        state["exp_avg"] = keep(torch.zeros_like(p, memory_format=torch.preserve_format))
        state["exp_avg_sq"] = keep(torch.zeros_like(p, memory_format=torch.preserve_format))
        if amsgrad:
            state["max_exp_avg_sq"] = keep(torch.zeros_like(p, memory_format=torch.preserve_format))
    return state


def _as_is(t: torch.Tensor) -> torch.Tensor:
    return t


class TiledAdam:
    """Runs a torch Adam/AdamW optimizer's update tile by tile (001 §7.2).

    The optimizer keeps its class, param groups, hyper-parameters and state (checkpoints
    and LR schedulers see nothing new); only the arithmetic of its ``step`` is driven
    here, one tile at a time through :class:`TileBuffer`.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, tile_size: int, keep: KeepState | None = None) -> None:
        """``keep``: where each new state tensor lives (optimizer offload passes its host store's
        :meth:`ds_ext.optim.offload.OffloadStore.keep`); None: where torch's Adam creates it."""
        check_tileable(optimizer, tile_size)
        self.optimizer = optimizer
        self.keep = keep or _as_is
        self.buffer = TileBuffer(tile_size)
        self._in_step = False
        self._ds_fused = ds_fused_adam.is_fused_adam(optimizer)
        self._group_steps: dict[int, int] = {}  # FusedAdam: this step's counter per group
        self.step_holders: dict[int, torch.Tensor] = {}  # FusedAdam: the group's last parameter with a gradient

    @property
    def tile_size(self) -> int:
        return self.buffer.tile_size

    def _run_hooks(self, post: bool) -> None:
        """The optimizer's registered step hooks (``register_step_pre_hook`` /
        ``register_step_post_hook``, global ones first, as ``Optimizer.step`` runs them),
        once per applied step: the tiled step replaces ``optimizer.step``."""
        from torch.optim import optimizer as torch_optimizer

        opt = self.optimizer
        if post:
            hooks = (*torch_optimizer._global_optimizer_post_hooks.values(), *opt._optimizer_step_post_hooks.values())
        else:
            hooks = (*torch_optimizer._global_optimizer_pre_hooks.values(), *opt._optimizer_step_pre_hooks.values())
        for hook in hooks:
            hook(opt, (), {})

    def end_step(self) -> None:
        """Release the tile buffer and run the step post-hooks; every integration calls
        this when its step is done (a skipped step never started one: no hooks)."""
        self.buffer.release()
        self._group_steps.clear()
        self.step_holders.clear()
        if self._in_step:
            self._in_step = False
            self._run_hooks(post=True)

    @torch.no_grad()
    def update(
        self,
        param: torch.Tensor,
        group: dict,
        load: LoadTile,
        store: StoreTile | None = None,
        after_tile: Callable[[], None] | None = None,
    ) -> None:
        """One Adam step of the fp32 tensor ``param`` (a member of ``group``), tile by tile.

        ``load`` fills the buffer with the tile's final fp32 gradient; ``store`` publishes
        the updated master slice; ``after_tile`` runs after each tile (ZeRO-topo advances
        its pipelined weight all-gather there).
        """
        if param.dtype != torch.float32 or not param.is_contiguous():
            raise ValueError("the tiled step updates contiguous fp32 master tensors")
        if not self._in_step:  # the step's first update: it is applied
            self._in_step = True
            self._run_hooks(post=False)
        if param not in self.optimizer.state and not any(param is q for q in group["params"]):
            raise ValueError("the tiled step needs the optimizer's own parameter object (its state is keyed by it)")
        if self._ds_fused:
            self._ds_fused_update(param, group, load, store, after_tile)
            return
        beta1, beta2 = group["betas"]
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        amsgrad, maximize = group["amsgrad"], group["maximize"]
        decoupled = group.get("decoupled_weight_decay", isinstance(self.optimizer, torch.optim.AdamW))
        fused = bool(group.get("fused"))
        state = _adam_state(self.optimizer, param, amsgrad, fused, self.keep)
        state["step"] += 1
        if fused:
            self._fused_update(param, group, state, load, store, after_tile)
            return
        step = state["step"].item()
        bias_correction1 = 1 - beta1**step
        bias_correction2 = 1 - beta2**step
        step_size = lr / bias_correction1
        bias_correction2_sqrt = bias_correction2**0.5
        flat_p = param.view(-1)
        flat_m = state["exp_avg"].view(-1)
        flat_v = state["exp_avg_sq"].view(-1)
        flat_vmax = state["max_exp_avg_sq"].view(-1) if amsgrad else None
        n = flat_p.numel()
        for s in range(0, n, self.tile_size):
            e = min(s + self.tile_size, n)
            buf = self.buffer.view(e - s, param.device)
            load(buf, s)
            p, m, v = flat_p[s:e], flat_m[s:e], flat_v[s:e]
            if maximize:
                buf.neg_()
            if wd != 0:
                if decoupled:
                    p.mul_(1 - lr * wd)
                else:
                    buf.add_(p, alpha=wd)
            m.lerp_(buf, 1 - beta1)
            v.mul_(beta2).addcmul_(buf, buf, value=1 - beta2)
            # the gradient in buf is consumed: reuse buf for the denominator
            if flat_vmax is not None:
                vmax = flat_vmax[s:e]
                torch.maximum(vmax, v, out=vmax)
                torch.sqrt(vmax, out=buf)
            else:
                torch.sqrt(v, out=buf)
            buf.div_(bias_correction2_sqrt).add_(eps)
            p.addcdiv_(m, buf, value=-step_size)
            self.buffer.tiles_processed += 1
            if store is not None:
                store(s, e)
            if after_tile is not None:
                after_tile()

    def _fused_update(self, param, group, state, load, store, after_tile) -> None:
        """torch's fused Adam/AdamW kernel (``torch._fused_adam(w)_``, what ``fused=True``
        runs) on each tile: the step counter is raised once per step, as
        ``torch.optim.adam._fused_adam`` does before its one kernel call; the kernel is
        elementwise, so tiles give the bits of the whole tensor (tested)."""
        beta1, beta2 = group["betas"]
        decoupled = group.get("decoupled_weight_decay", isinstance(self.optimizer, torch.optim.AdamW))
        kernel = torch._fused_adamw_ if decoupled else torch._fused_adam_
        flat = [param.view(-1), state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1)]
        vmax = state["max_exp_avg_sq"].view(-1) if group["amsgrad"] else None
        n = flat[0].numel()
        for s in range(0, n, self.tile_size):
            e = min(s + self.tile_size, n)
            buf = self.buffer.view(e - s, param.device)
            load(buf, s)
            p, m, v = (t[s:e] for t in flat)
            kernel(
                [p],
                [buf],
                [m],
                [v],
                [vmax[s:e]] if vmax is not None else [],
                [state["step"]],
                amsgrad=group["amsgrad"],
                lr=group["lr"],
                beta1=beta1,
                beta2=beta2,
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=group["maximize"],
                grad_scale=None,
                found_inf=None,
            )
            self.buffer.tiles_processed += 1
            if store is not None:
                store(s, e)
            if after_tile is not None:
                after_tile()

    def _ds_fused_update(self, param, group, load, store, after_tile) -> None:
        """DeepSpeed's FusedAdam kernel on each tile; the group's counter is raised once per step
        on its last parameter with a gradient (``step_holders``; by default the group's last
        parameter, the one flat partition ZeRO-1/2 gives each group), as ``FusedAdam.step`` does."""
        st = ds_fused_adam.state(self.optimizer, param, group)
        key = id(group)
        if key not in self._group_steps:
            holder = ds_fused_adam.state(self.optimizer, self.step_holders.get(key, group["params"][-1]), group)
            holder["step"] += 1
            self._group_steps[key] = holder["step"]
        step = self._group_steps[key]
        flat = [param.view(-1), st["exp_avg"].view(-1), st["exp_avg_sq"].view(-1)]
        n = flat[0].numel()
        for s in range(0, n, self.tile_size):
            e = min(s + self.tile_size, n)
            buf = self.buffer.view(e - s, param.device)
            load(buf, s)
            ds_fused_adam.apply(self.optimizer, group, step, buf, *(t[s:e] for t in flat))
            self.buffer.tiles_processed += 1
            if store is not None:
                store(s, e)
            if after_tile is not None:
                after_tile()

    def step_fp32_params(self) -> None:
        """Tiled step of a plain optimizer whose params hold their own fp32 ``.grad``
        (DeepSpeed stage 0 in fp32): same result as ``optimizer.step()``."""
        for group in self.optimizer.param_groups:
            with_grad = [p for p in group["params"] if p.grad is not None]
            if with_grad:
                self.step_holders[id(group)] = with_grad[-1]
            for p in with_grad:
                if p.dtype != torch.float32:
                    raise DsExtConfigError(
                        f"{KEY}: a stage-0 fp32 engine holds a {p.dtype} parameter; enable the "
                        "ds_config 'bf16' or 'fp16' section for 16-bit parameters"
                    )
                flat_g = p.grad.view(-1)

                def load(buf: torch.Tensor, s: int, flat_g=flat_g) -> None:
                    buf.copy_(flat_g[s : s + buf.numel()])

                self.update(p, group, load)
        self.end_step()


def piecewise_loader(
    pieces: list[torch.Tensor], total: int, scale: Callable[[torch.Tensor], None] | None = None
) -> LoadTile:
    """A :data:`LoadTile` over the concatenation of ``pieces`` (any dtype), zero-padded to
    ``total`` elements, without materialising the concatenation: the tile is up-cast piece
    by piece into the buffer, then ``scale(buf)`` unscales / clips it in place."""
    flat = [t.reshape(-1) for t in pieces]
    starts = list(itertools.accumulate((t.numel() for t in flat), initial=0))
    if starts[-1] > total:
        raise ValueError(f"pieces hold {starts[-1]} elements, more than the partition's {total}")

    def load(buf: torch.Tensor, s: int) -> None:
        e = s + buf.numel()
        covered = s
        k = bisect.bisect_right(starts, s) - 1  # the first piece that can overlap [s, e)
        while k < len(flat) and starts[k] < e:
            a, b = starts[k], starts[k + 1]
            if b > s:
                lo, hi = max(a, s), min(b, e)
                buf[lo - s : hi - s].copy_(flat[k][lo - a : hi - a])
                covered = hi
            k += 1
        if covered < e:
            buf[covered - s :].zero_()
        if scale is not None:
            scale(buf)

    return load
