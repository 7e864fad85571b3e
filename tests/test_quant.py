"""Block quantizer (ds_ext/comm/quant.py): error bound, wire format, padding, edge cases.

References: the bound |x - x̂| <= absmax / (2^(b-1) - 1) / 2 per block, and a per-element
encoder written here from the format's definition.
"""

import pytest
import torch

from ds_ext.comm.quant import BlockQuantizer, QuantizationError


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("numel,block", [(4096, 512), (1000, 64), (7, 8), (513, 512)])
def test_error_bound(bits, numel, block):
    torch.manual_seed(numel + bits)
    x = torch.randn(numel) * torch.logspace(-3, 2, numel)  # blocks of very different scales
    qz = BlockQuantizer(bits, block)
    y = qz.dequantize(qz.quantize(x))
    assert y.shape == x.shape
    pad = torch.zeros(qz.padded_numel(numel))
    pad[:numel] = x
    absmax = pad.view(-1, block).abs().amax(1).repeat_interleave(block)[:numel]
    bound = absmax / (2 ** (bits - 1) - 1) / 2 + 1e-6 * absmax + 1e-12
    assert torch.all((x - y).abs() <= bound)
    # and the bound is tight enough to mean something: most errors are non-zero
    assert (x - y).abs().max() > 0.1 * bound.max()


@pytest.mark.parametrize("bits", [4, 8])
def test_wire_format(bits):
    qz = BlockQuantizer(bits, block_size=4)
    x = torch.tensor([1.0, -0.5, 0.25, -1.0, 3.0, 0.0, -3.0, 1.5, 0.7])  # 9 -> 3 padded blocks
    q = qz.quantize(x)
    qmax = 2 ** (bits - 1) - 1
    pad = torch.cat([x, torch.zeros(3)]).view(3, 4)
    scales = pad.abs().amax(1) / qmax
    assert torch.equal(q.scales, scales)
    codes = torch.where(scales[:, None] > 0, torch.round(pad / scales.clamp_min(1e-30)[:, None]), 0).view(-1)
    if bits == 8:
        assert q.payload.dtype == torch.int8 and torch.equal(q.payload.long(), codes.long())
    else:  # two codes per byte, stored as q + 8: element j low nibble, element j + B/2 high
        assert q.payload.dtype == torch.uint8 and q.payload.numel() == 6
        u = (codes.long() + 8).view(3, 2, 2)
        assert torch.equal(q.payload.long(), (u[:, 0] | (u[:, 1] << 4)).view(-1))
    assert q.wire_bytes == qz.wire_bytes(9) == 12 * bits // 8 + 3 * 4
    assert q.numel == 9


def test_zero_blocks_decode_to_zero():
    qz = BlockQuantizer(4, 8)
    x = torch.cat([torch.zeros(8), torch.ones(8)])
    y = qz.dequantize(qz.quantize(x))
    assert torch.equal(y[:8], torch.zeros(8)) and torch.isfinite(y).all()
    assert torch.allclose(y[8:], torch.ones(8))


def test_dequantize_into_bf16_out():
    qz = BlockQuantizer(8, 16)
    x = torch.randn(40)
    out = torch.empty(40, dtype=torch.bfloat16)
    qz.dequantize(qz.quantize(x), out=out)
    assert torch.allclose(out.float(), x, atol=x.abs().max().item() / 127)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_is_an_error(bad):
    x = torch.ones(10)
    x[3] = bad
    with pytest.raises(QuantizationError, match="non-finite"):
        BlockQuantizer(8).quantize(x)


def test_bad_settings():
    with pytest.raises(QuantizationError, match="bits must be one of"):
        BlockQuantizer(2)
    with pytest.raises(QuantizationError, match="even"):
        BlockQuantizer(4, 7)
    with pytest.raises(QuantizationError, match="block"):
        BlockQuantizer(8, 4).dequantize(BlockQuantizer(8, 8).quantize(torch.ones(8)))


@pytest.mark.parametrize("bits", [4, 8])
def test_compiled_quantizer_matches_eager(bits):
    """compile=True (ZeRO-topo's default) gives the eager bits, in both non-finite modes;
    tensors below COMPILE_MIN_NUMEL use the eager kernels themselves."""
    from ds_ext.comm import quant

    n = quant.COMPILE_MIN_NUMEL + 3000
    x = torch.randn(n).to(torch.bfloat16)
    eager, fused = BlockQuantizer(bits, 64), BlockQuantizer(bits, 64, compile=True)
    assert fused._kernels_for(n)[0] is not quant._encode and fused._kernels_for(n - 3001)[0] is quant._encode
    a, b = eager.quantize(x), fused.quantize(x)
    assert torch.equal(a.payload, b.payload) and torch.equal(a.scales, b.scales)
    assert torch.equal(eager.dequantize(a), fused.dequantize(a))
    x[5] = float("nan")
    a, b = eager.quantize(x, nonfinite="flag"), fused.quantize(x, nonfinite="flag")
    assert torch.equal(a.payload, b.payload) and torch.equal(a.scales, b.scales) and a.scales[0] == quant.NONFINITE
    assert torch.equal(eager.dequantize(a).isnan(), fused.dequantize(b).isnan())
    with pytest.raises(QuantizationError, match="non-finite"):
        fused.quantize(x)
