"""The one-launch Triton quantizer kernels (ds_ext/comm/quant_triton.py) in Triton's interpreter
on the CPU, against the CPU path of the same quantizer (ds_ext/comm/quant.py's eager torch
bodies, which share no code with the kernels): payload, scales and decoded values bit for bit;
non-finite blocks flagged or raised. ``tests/test_gpu.py`` runs the same kernels compiled.

The interpreter needs ``TRITON_INTERPRET=1`` before Triton is imported, so the checks run in a
child process. Its fp32 -> bf16 conversion truncates, where compiled Triton rounds to nearest
even as torch does; the child replaces that one conversion with torch's.
"""

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

CHILD = textwrap.dedent(
    """
    import numpy as np
    import torch
    import triton.language as tl
    import triton.runtime.interpreter as interp

    from ds_ext.comm.quant import NONFINITE, BlockQuantizer, QuantizationError
    from ds_ext.comm.quant_triton import TritonQuantKernels

    convert = interp._convert_float

    def convert_rne(data, src, dst, rounding):  # the interpreter truncates fp32 -> bf16
        if src == tl.float32 and dst == tl.bfloat16:
            t = torch.from_numpy(np.ascontiguousarray(data).view(np.float32)).to(torch.bfloat16)
            return t.view(torch.int16).numpy().view(np.uint16)
        return convert(data, src, dst, rounding)

    interp._convert_float = convert_rne

    def on_triton(bits, block):
        # the compile=True quantizer as an accelerator runs it, here on CPU tensors
        qz = BlockQuantizer(bits, block, compile=True)
        qz._triton = TritonQuantKernels(bits, block)
        qz._triton_kernels = lambda device: qz._triton
        return qz

    def sample(n, dtype):
        g = torch.Generator().manual_seed(n)
        x = torch.randn(n, generator=g) * torch.logspace(-6, 4, n)  # ten decades of magnitude
        x[3 * 64 : 4 * 64] = 0.0  # an all-zero block
        return x.to(dtype)

    cases = 0
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for bits in (8, 4):
            for block, n in ((512, 5000), (512, 16384), (64, 1000), (33 if bits == 8 else 34, 999)):
                cpu, tri = BlockQuantizer(bits, block), on_triton(bits, block)
                x = sample(n, dtype)
                ref, got = cpu.quantize(x), tri.quantize(x)
                assert torch.equal(got.payload, ref.payload), (dtype, bits, block, n, "payload")
                assert torch.equal(got.scales.view(torch.int32), ref.scales.view(torch.int32)), (dtype, bits, n)
                for out in (torch.float32, torch.bfloat16, torch.float16):
                    want = cpu.dequantize(ref, out)
                    assert torch.equal(tri.dequantize(got, out), want), (dtype, bits, block, n, out)
                    into = torch.full((n,), 7.0, dtype=out)
                    assert tri.dequantize(got, out=into) is into and torch.equal(into, want)
                cases += 1

    x = sample(20000, torch.float16)
    x[7], x[12001] = float("inf"), float("nan")
    for bits in (8, 4):
        ref = BlockQuantizer(bits, 512).quantize(x, nonfinite="flag")
        tri = on_triton(bits, 512)
        got = tri.quantize(x, nonfinite="flag")
        assert torch.equal(got.payload, ref.payload)
        assert torch.equal(got.scales.view(torch.int32), ref.scales.view(torch.int32))
        assert int((got.scales == NONFINITE).sum()) == 2
        decoded = tri.dequantize(got)
        assert decoded[:512].isnan().all() and decoded[512:11776].isfinite().all()
        try:
            tri.quantize(x)
        except QuantizationError as e:
            assert "2 non-finite elements of 20000" in str(e), e
        else:
            raise AssertionError("a non-finite weight was encoded")
        tri.quantize(sample(20000, torch.float16))  # a clean call after a raising one passes
    print("CASES", cases)
    """
)


def test_triton_kernels_equal_the_cpu_path_bit_for_bit():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONWARNINGS="ignore")
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "CASES 24" in done.stdout
