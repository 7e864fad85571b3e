"""The block quantizer's encode and decode on an accelerator, one Triton kernel launch each.

Same arithmetic, bits and wire format as :mod:`ds_ext.comm.quant` (ZeRO++ qwZ / qgZ, 003 §V-A):
per block absmax ``a``, ``s = fp32(a / qmax)`` and ``1/s`` rounded once from fp64, codes
``clamp(rint(x * fp32(1/s)), -qmax, qmax)`` with rounding half to even, int4 codes ``q + 8``
with element ``j`` in the low nibble and ``j + B/2`` in the high one. One program encodes
``ROWS`` whole blocks: it reads each element once, pads the last block with zeros itself
(no padded copy), and writes codes and scales.

Non-finite input is found inside the same kernel: such a block is written as zero codes with
the scale ``NONFINITE`` (the gradient path, ``nonfinite="flag"``: nothing waits for the
device), and with ``check`` the kernel also raises a one-word flag to this call's number
(``atomic_max``), which the weight path (``nonfinite="raise"``) reads with the one host
wait a raise needs; no second kernel scans the input or the scales.

Floating-point contraction is off (``enable_fp_fusion=False``): ``x * (1/s)`` must round to
fp32 before the rounding to an integer, as on the CPU, or a fused multiply-add would change
codes next to a rounding boundary. ``tests/test_quant_triton.py`` runs these kernels in
Triton's interpreter on the CPU against the CPU path, bit for bit; ``tests/test_gpu.py`` runs
them compiled on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ds_ext.comm.quant_format import NONFINITE

TILE_ELEMENTS = 4096  # elements per program (ROWS blocks of B), a power of two
_NONFINITE = tl.constexpr(NONFINITE)  # a kernel reads only constexpr globals


@triton.jit
def _rint(p):
    """Round to the nearest integer, ties to even (``torch.round``), from exact steps only."""
    f = tl.floor(p)
    d = p - f  # exact: |p| < 2^23
    odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
    return tl.where((d > 0.5) | ((d == 0.5) & odd), f + 1.0, f)


@triton.jit(do_not_specialize=["numel", "n_blocks", "call_id"])
def _encode_kernel(
    x_ptr,
    payload_ptr,
    scales_ptr,
    flag_ptr,
    numel,
    n_blocks,
    call_id,
    B: tl.constexpr,
    HALF: tl.constexpr,
    HALF_P2: tl.constexpr,
    ROWS: tl.constexpr,
    QMAX: tl.constexpr,
    PACK4: tl.constexpr,
    CHECK: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, HALF_P2)
    row_ok = rows < n_blocks
    ok = row_ok[:, None] & (cols < HALF)[None, :]
    hi_ok = row_ok[:, None] & (cols < B - HALF)[None, :]  # an odd int8 block: one element fewer
    lo_idx = rows.to(tl.int64)[:, None] * B + cols[None, :]
    hi_idx = lo_idx + HALF
    if (tl.program_id(0).to(tl.int64) + 1) * (ROWS * B) <= numel:  # whole blocks: vector loads
        lo = tl.load(x_ptr + lo_idx, mask=ok, other=0.0).to(tl.float32)
        hi = tl.load(x_ptr + hi_idx, mask=hi_ok, other=0.0).to(tl.float32)
    else:  # the tail: zero padding past numel
        lo = tl.load(x_ptr + lo_idx, mask=ok & (lo_idx < numel), other=0.0).to(tl.float32)
        hi = tl.load(x_ptr + hi_idx, mask=hi_ok & (hi_idx < numel), other=0.0).to(tl.float32)
    # one reduction per half gives absmax and non-finiteness: NaN and inf count as inf
    inf = float("inf")
    top = tl.maximum(
        tl.max(tl.where(tl.abs(lo) < inf, tl.abs(lo), inf), axis=1),
        tl.max(tl.where(tl.abs(hi) < inf, tl.abs(hi), inf), axis=1),
    )
    bad = top == inf
    amax = tl.where(bad, 0.0, top)
    lo = tl.where(bad[:, None], 0.0, lo)
    hi = tl.where(bad[:, None], 0.0, hi)
    scale = (amax.to(tl.float64) / QMAX).to(tl.float32)
    inv = tl.where(scale > 0.0, (1.0 / scale.to(tl.float64)).to(tl.float32), 0.0)
    q_lo = tl.minimum(tl.maximum(_rint(lo * inv[:, None]), -QMAX), QMAX)
    q_hi = tl.minimum(tl.maximum(_rint(hi * inv[:, None]), -QMAX), QMAX)
    tl.store(scales_ptr + rows, tl.where(bad, _NONFINITE, scale), mask=row_ok)
    if PACK4:
        byte = (q_lo.to(tl.int32) + 8) + 16 * (q_hi.to(tl.int32) + 8)
        tl.store(payload_ptr + rows.to(tl.int64)[:, None] * HALF + cols[None, :], byte.to(tl.uint8), mask=ok)
    else:
        tl.store(payload_ptr + lo_idx, q_lo.to(tl.int8), mask=ok)
        tl.store(payload_ptr + hi_idx, q_hi.to(tl.int8), mask=hi_ok)
    if CHECK:
        if tl.max(bad.to(tl.int32), axis=0) > 0:
            tl.atomic_max(flag_ptr, call_id)


@triton.jit(do_not_specialize=["numel", "n_blocks"])
def _decode_kernel(
    payload_ptr,
    scales_ptr,
    out_ptr,
    numel,
    n_blocks,
    B: tl.constexpr,
    HALF: tl.constexpr,
    HALF_P2: tl.constexpr,
    ROWS: tl.constexpr,
    PACK4: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, HALF_P2)
    row_ok = rows < n_blocks
    ok = row_ok[:, None] & (cols < HALF)[None, :]
    hi_ok = row_ok[:, None] & (cols < B - HALF)[None, :]
    lo_idx = rows.to(tl.int64)[:, None] * B + cols[None, :]
    hi_idx = lo_idx + HALF
    s = tl.load(scales_ptr + rows, mask=row_ok, other=0.0)
    s = tl.where(s < 0.0, float("nan"), s)[:, None]  # NONFINITE blocks decode to NaN
    if PACK4:
        byte = tl.load(payload_ptr + rows.to(tl.int64)[:, None] * HALF + cols[None, :], mask=ok, other=0)
        byte = byte.to(tl.int32)
        q_lo, q_hi = (byte & 15) - 8, (byte >> 4) - 8
    else:
        q_lo = tl.load(payload_ptr + lo_idx, mask=ok, other=0).to(tl.int32)
        q_hi = tl.load(payload_ptr + hi_idx, mask=hi_ok, other=0).to(tl.int32)
    ty = out_ptr.dtype.element_ty
    v_lo, v_hi = (q_lo.to(tl.float32) * s).to(ty), (q_hi.to(tl.float32) * s).to(ty)
    if (tl.program_id(0).to(tl.int64) + 1) * (ROWS * B) <= numel:  # whole blocks: vector stores
        tl.store(out_ptr + lo_idx, v_lo, mask=ok)
        tl.store(out_ptr + hi_idx, v_hi, mask=hi_ok)
    else:
        tl.store(out_ptr + lo_idx, v_lo, mask=ok & (lo_idx < numel))
        tl.store(out_ptr + hi_idx, v_hi, mask=hi_ok & (hi_idx < numel))


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0


class TritonQuantKernels:
    """Launch geometry of one quantizer (bits, block size), its compiled kernels and its
    non-finite flag words (one per device, compared against a call number that grows, so
    nothing resets them).

    Launches after the first go straight to the compiled kernel: Triton's own dispatch (argument
    binding, specialization, cache key) costs host time per call that small tensors' kernels do
    not hide (docs/benchmarks/gpu.md). The kernels specialize on nothing but the pointer
    arguments' types and 16-byte alignment (the integers are ``do_not_specialize``; an integer
    from 2^31 up is a 64-bit argument), so the cache key holds exactly those. Triton's
    interpreter hands back no compiled kernel: there every call is dispatched.
    """

    def __init__(self, bits: int, block_size: int, tile_elements: int = TILE_ELEMENTS, num_warps: int = 4) -> None:
        half = block_size // 2 if bits == 4 else -(-block_size // 2)
        half_p2 = triton.next_power_of_2(half)
        self.rows = max(1, tile_elements // (2 * half_p2))
        self.meta = (block_size, half, half_p2, self.rows)
        self.num_warps = num_warps
        self.qmax, self.pack4, self.block_size = 2 ** (bits - 1) - 1, bits == 4, block_size
        self._flags: dict[torch.device, torch.Tensor] = {}
        self._calls = 0
        self._compiled: dict[tuple, object] = {}

    def _launch(self, kernel, key: tuple, grid: tuple[int, int, int], args: tuple) -> None:
        compiled = self._compiled.get(key)
        if compiled is not None:
            compiled[grid](*args)
            return
        compiled = kernel[grid](*args, num_warps=self.num_warps, enable_fp_fusion=False)
        if compiled is not None:
            self._compiled[key] = compiled

    def encode(self, flat: torch.Tensor, n_blocks: int, check: bool) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """1-D ``flat`` -> (payload, scales, any non-finite block); the last is read from the
        device only with ``check`` (one wait), else False without waiting."""
        dev = flat.device
        payload = torch.empty(
            n_blocks * self.block_size // (2 if self.pack4 else 1),
            dtype=torch.uint8 if self.pack4 else torch.int8,
            device=dev,
        )
        scales = torch.empty(n_blocks, dtype=torch.float32, device=dev)
        if n_blocks == 0:
            return payload, scales, False
        flag = self._flags.get(dev)
        if flag is None:
            flag = self._flags[dev] = torch.zeros(1, dtype=torch.int64, device=dev)
        self._calls = self._calls % (2**31 - 1) + 1  # a 32-bit argument
        numel = flat.numel()
        key = ("encode", dev, flat.dtype, _aligned(flat), numel >= 2**31, check)
        self._launch(
            _encode_kernel,
            key,
            (-(-n_blocks // self.rows), 1, 1),
            (flat, payload, scales, flag, numel, n_blocks, self._calls, *self.meta, self.qmax, self.pack4, check),
        )
        return payload, scales, check and int(flag.item()) == self._calls

    def decode(self, payload: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Write the first ``out.numel()`` decoded values into contiguous ``out``."""
        n_blocks, numel = scales.numel(), out.numel()
        if numel == 0:
            return out
        key = ("decode", out.device, out.dtype, _aligned(payload), _aligned(scales), _aligned(out), numel >= 2**31)
        self._launch(
            _decode_kernel,
            key,
            (-(-n_blocks // self.rows), 1, 1),
            (payload, scales, out, numel, n_blocks, *self.meta, self.pack4),
        )
        return out
