"""Symmetric block quantizer, int8 and int4 (ZeRO++ qwZ / qgZ, reused by 003 §V-A).

Notation: b bits, B block size, per block absmax a, qmax = 2^(b-1) - 1,
scale s = a / qmax (fp32), code q = clamp(round(x / s), -qmax, qmax), x̂ = q s.
``s`` and ``1 / s`` are the correctly rounded fp32 quotients on every device, eager or
compiled (so CUDA and CPU give the same bits: tests/test_gpu.py). ``torch.round`` rounds half
to even like the CUDA kernels' ``__float2int_rn`` (DeepSpeed's
pure-torch NPU quantizer truncates instead, which doubles the error; spec note). So
``|x - x̂| <= s / 2 = a / qmax / 2`` for every element. An all-zero block has s = 0 and
decodes to exact zeros.

Non-finite input is never encoded. By default it is an error; with
``nonfinite="flag"`` (fp16 gradients, whose overflow is an expected event) a block that
holds a non-finite value travels as zero codes with the scale :data:`NONFINITE` (-1, a
value no real scale takes: scales are >= 0), and decodes to NaN. The flag rides in the
scales the wire carries anyway, so an overflow on one rank reaches every receiver at no
extra byte, and the step's norm check (which sees NaN) skips the step on every rank.

Wire format: ``payload`` int8 codes (int8), or two int4 codes per uint8 byte, stored as
q + 8: byte j of a block holds element j in the low nibble and element j + B/2 in the
high nibble (both halves are read contiguously, so the encode vectorises; DeepSpeed's
even/odd pairing does not); ``scales`` fp32, one per block. The input is zero padded to
whole blocks, so blocks never straddle two ranks' chunks when a caller cuts a tensor
into whole-block chunks.

Kernels: eager torch (``compile=False``), or fused (``compile=True``, ZeRO-topo's default):
on an accelerator one Triton kernel launch per encode and per decode
(:mod:`ds_ext.comm.quant_triton`: no padded copy, the non-finite check inside the kernel);
on the CPU ``torch.compile`` fuses the bodies below into one pass per block, for tensors from
:data:`COMPILE_MIN_NUMEL` elements up (a few seconds of compilation per process once, cached
on disk by inductor; below, the eager kernels take tens of microseconds and compiling would
not pay off). Every path gives the same bits (``tests/test_quant.py``,
``tests/test_quant_triton.py``, ``tests/test_gpu.py``); ``ds-ext bench quant`` times them
against DeepSpeed's quantizers and a copy (docs/benchmarks/quantizer.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ds_ext.comm.quant_format import ALLOWED_BITS, NONFINITE
from ds_ext.errors import DsExtError

COMPILE_MIN_NUMEL = 1 << 16  # compile=True on the CPU: tensors of fewer elements use the eager kernels (same bits)


class QuantizationError(DsExtError, ValueError):
    """Bad quantizer settings or input that cannot be quantized."""


@dataclass(frozen=True)
class QuantizedTensor:
    payload: torch.Tensor
    scales: torch.Tensor
    bits: int
    numel: int
    block_size: int

    @property
    def wire_bytes(self) -> int:
        return self.payload.numel() * self.payload.element_size() + self.scales.numel() * 4


def _encode(blocks: torch.Tensor, qmax: int, pack4: bool, flag: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``[blocks, B]`` of any float dtype -> (payload, fp32 scales). Non-finite input gives
    non-finite scales, or with ``flag`` zero codes and the scale :data:`NONFINITE` (decided on
    the device: no host wait). The cast to fp32 happens here, inside the fused region."""
    x = blocks.float()
    amax = x.abs().amax(dim=1, keepdim=True)  # NaN / inf propagate
    if flag:
        finite = torch.isfinite(amax)
        x, amax = torch.where(finite, x, 0.0), torch.where(finite, amax, 0.0)
    # both divisions in fp64, rounded once to fp32: the correctly rounded quotient on every
    # device and compiler (ATen's CUDA kernel multiplies by the divisor's reciprocal when it
    # is a host scalar, and a compiler may do the same: one ulp off, other codes downstream)
    scales = (amax.double() / qmax).float()
    inv = torch.where(scales > 0, (1.0 / scales.double()).float(), 0.0)
    codes = torch.round(x * inv).clamp(-qmax, qmax)
    if flag:
        scales = torch.where(finite, scales, NONFINITE)
    if pack4:  # element j in the low nibble, element j + B/2 in the high one
        half = codes.shape[1] // 2
        codes = codes + 8
        return (codes[:, :half] + 16 * codes[:, half:]).to(torch.uint8).reshape(-1), scales.reshape(-1)
    return codes.to(torch.int8).reshape(-1), scales.reshape(-1)


def _decode(
    payload: torch.Tensor, scales: torch.Tensor, block_size: int, pack4: bool, dtype: torch.dtype
) -> torch.Tensor:
    """(payload, scales) -> values of the padded blocks, computed in fp32 and cast to ``dtype``
    inside the fused region (one pass writes the result)."""
    if pack4:
        p = payload.view(-1, block_size // 2).to(torch.int16)
        codes = torch.cat([(p & 15) - 8, (p >> 4) - 8], dim=1)
    else:
        codes = payload.view(-1, block_size)
    return (codes.float() * scales[:, None]).reshape(-1).to(dtype)


_COMPILED: dict[str, Callable] = {}


def _kernels(compile: bool) -> tuple[Callable, Callable]:
    """The encode / decode bodies, eager or fused by ``torch.compile`` (once per process;
    ``ds-ext bench quant`` measures the two). Compiled with the block size static and only
    the number of blocks dynamic: the inner loop then vectorises without a tail."""
    if not compile:
        return _encode, _decode
    if not _COMPILED:
        encode, decode = torch.compile(_encode, dynamic=False), torch.compile(_decode, dynamic=False)

        def compiled_encode(blocks: torch.Tensor, qmax: int, pack4: bool, flag: bool):
            torch._dynamo.maybe_mark_dynamic(blocks, 0)
            return encode(blocks, qmax, pack4, flag)

        def compiled_decode(
            payload: torch.Tensor, scales: torch.Tensor, block_size: int, pack4: bool, dtype: torch.dtype
        ):
            torch._dynamo.maybe_mark_dynamic(payload, 0)
            torch._dynamo.maybe_mark_dynamic(scales, 0)
            return decode(payload, scales, block_size, pack4, dtype)

        _COMPILED.update(encode=compiled_encode, decode=compiled_decode)
    return _COMPILED["encode"], _COMPILED["decode"]


class BlockQuantizer:
    """Quantize / dequantize 1-D views in blocks of ``block_size`` elements.

    ``compile=True``: one Triton kernel per call on an accelerator; on the CPU the encode /
    decode bodies of tensors of at least :data:`COMPILE_MIN_NUMEL` elements run through
    ``torch.compile`` (module docstring). Same bits on every path.
    """

    def __init__(self, bits: int, block_size: int = 512, compile: bool = False) -> None:
        if bits not in ALLOWED_BITS:
            raise QuantizationError(f"quantizer bits must be one of {ALLOWED_BITS}, got {bits}")
        if not isinstance(block_size, int) or block_size <= 0 or (bits == 4 and block_size % 2):
            raise QuantizationError(
                f"quantizer block_size must be a positive{' even' if bits == 4 else ''} integer, got {block_size}"
            )
        self.bits = bits
        self.block_size = block_size
        self.qmax = 2 ** (bits - 1) - 1
        self.compile = compile
        self._triton = None  # ds_ext.comm.quant_triton.TritonQuantKernels, made on first accelerator use

    def _triton_kernels(self, device: torch.device):
        """The one-launch kernels where ``compile=True`` meets an accelerator tensor, else None."""
        if not self.compile or device.type == "cpu":
            return None
        if self._triton is None:
            try:
                from ds_ext.comm.quant_triton import TritonQuantKernels
            except ImportError as e:
                raise QuantizationError(
                    f"zero_topo.compile_quantizer: true needs Triton on {device.type} ({e}); install triton "
                    "(PyTorch's GPU wheels bring it) or set compile_quantizer: false"
                ) from e
            self._triton = TritonQuantKernels(self.bits, self.block_size)
        return self._triton

    def _kernels_for(self, numel: int) -> tuple[Callable, Callable]:
        return _kernels(self.compile and numel >= COMPILE_MIN_NUMEL)

    def num_blocks(self, numel: int) -> int:
        return -(-numel // self.block_size)

    def padded_numel(self, numel: int) -> int:
        return self.num_blocks(numel) * self.block_size

    def wire_bytes(self, numel: int) -> int:
        return self.padded_numel(numel) * self.bits // 8 + 4 * self.num_blocks(numel)

    def quantize(self, x: torch.Tensor, nonfinite: str = "raise") -> QuantizedTensor:
        """Encode ``x``; a non-finite element raises, or with ``nonfinite="flag"`` marks its
        block :data:`NONFINITE` instead of encoding it (module docstring). Raising needs the
        host to read the device (one wait per call on an accelerator); flagging does not."""
        if nonfinite not in ("raise", "flag"):
            raise QuantizationError(f"nonfinite must be 'raise' or 'flag', got {nonfinite!r}")
        flat = x if x.dim() == 1 else x.reshape(-1)
        n = flat.numel()
        triton_kernels = self._triton_kernels(flat.device)
        if triton_kernels is not None:
            payload, scales, bad = triton_kernels.encode(flat.contiguous(), self.num_blocks(n), nonfinite == "raise")
            if bad:
                self._raise_nonfinite(flat)
            return QuantizedTensor(payload, scales, self.bits, n, self.block_size)
        padded = self.padded_numel(n)
        if padded == n:
            blocks = flat
        else:
            blocks = torch.zeros(padded, dtype=flat.dtype, device=flat.device)
            blocks[:n] = flat
        blocks = blocks.view(-1, self.block_size)
        encode = self._kernels_for(padded)[0]
        q, scales = encode(blocks, self.qmax, self.bits == 4, nonfinite == "flag")
        if nonfinite == "raise" and not torch.isfinite(scales).all():  # NaN / inf reach the block's scale
            self._raise_nonfinite(flat)
        return QuantizedTensor(q, scales, self.bits, n, self.block_size)

    @staticmethod
    def _raise_nonfinite(flat: torch.Tensor) -> None:
        bad = (~torch.isfinite(flat)).sum().item()
        raise QuantizationError(f"cannot quantize a tensor with {bad} non-finite elements of {flat.numel()}")

    def dequantize(
        self, q: QuantizedTensor, dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        if q.bits != self.bits or q.block_size != self.block_size:
            raise QuantizationError(
                f"tensor was quantized with {q.bits} bits / block {q.block_size}, "
                f"this quantizer uses {self.bits} / {self.block_size}"
            )
        if out is not None and out.numel() != q.numel:
            raise QuantizationError(f"dequantize out has {out.numel()} elements, needs {q.numel}")
        triton_kernels = self._triton_kernels(q.payload.device)
        if triton_kernels is not None:
            target = torch.empty(q.numel, dtype=dtype, device=q.payload.device) if out is None else out.view(-1)
            triton_kernels.decode(q.payload, q.scales, target)
            return target if out is None else out
        scales = q.scales.masked_fill(q.scales < 0, float("nan"))  # NONFINITE blocks decode to NaN
        decode = self._kernels_for(q.scales.numel() * self.block_size)[1]
        values = decode(q.payload, scales, self.block_size, self.bits == 4, dtype if out is None else out.dtype)
        values = values[: q.numel]
        if out is None:
            return values
        out.view(-1).copy_(values)
        return out
