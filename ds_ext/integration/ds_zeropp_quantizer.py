"""DeepSpeed ZeRO++'s quantizer on CPU (benchmark baseline; read in DeepSpeed 0.19.8).

Behind the version gate of :mod:`ds_ext.integration.ds_version`.
"""

from __future__ import annotations

from ds_ext.integration.ds_version import check_version

check_version()


def enable_cpu_zeropp_quantizer() -> None:
    """Let DeepSpeed's own ZeRO++ (qwZ / qgZ) run on CPU, for the benchmark baseline.

    DeepSpeed's CUDA quantizer has no CPU build (spec/deepspeed_on_cpu.md §2); 0.19.8 ships
    a pure-torch ``NPUQuantizer`` with the same wire format. Route ``QuantizerBuilder`` to
    it (both call sites resolve the name at call time: partition_parameters.py:865,
    coalesced_collectives.py:34), flatten the ``[groups, 1]`` scales of ``quantize`` (gloo
    rejects an N-d input with a flat output) and round to nearest as the CUDA kernels do
    (``__float2int_rn``) instead of the NPU reference's truncation. Process-wide; meant
    for the ``ds-ext bench zero`` worker processes only.
    """
    import deepspeed.ops.op_builder as op_builder
    from deepspeed.ops.op_builder.npu.quantizer import NPUQuantizer

    def quantize_groups_rn(xg, num_bits):
        maxv = xg.abs().max(dim=1).values
        scale = float(1 << num_bits) / (2.0 * maxv)
        scale.masked_fill_(maxv == 0, 1.0)
        lim = 1 << (num_bits - 1)
        xg.mul_(scale.view(-1, 1)).round_().clamp_(-lim, lim - 1)
        return xg, scale.reciprocal().view(-1)

    class CpuQuantizer(NPUQuantizer):
        @staticmethod
        def quantize(input_vals, groups, num_bits, quant_type):
            q, scales = NPUQuantizer.quantize(input_vals, groups, num_bits, quant_type)
            return q, scales.view(-1)

    class CpuQuantizerBuilder:
        def load(self, verbose: bool = True):
            return CpuQuantizer

    NPUQuantizer._quantize_groups = staticmethod(quantize_groups_rn)
    op_builder.QuantizerBuilder = CpuQuantizerBuilder


def deepspeed_cpu_quantizer():
    """DeepSpeed's pure-torch ZeRO++ quantizer (``NPUQuantizer``: ``quantize``,
    ``swizzle_quant``, ``dequantize``), the baseline of ``ds-ext bench quant``."""
    from deepspeed.ops.op_builder.npu.quantizer import NPUQuantizer

    return NPUQuantizer


def deepspeed_cuda_quantizer():
    """DeepSpeed's CUDA quantizer module, the kernels ZeRO++ runs (``QuantizerBuilder().load()``,
    JIT-built on first use: partition_parameters.py:865, coalesced_collectives.py:34)."""
    from deepspeed.ops.op_builder import QuantizerBuilder

    return QuantizerBuilder().load()
