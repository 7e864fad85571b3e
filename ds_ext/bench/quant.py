"""``ds-ext bench quant``: ds_ext's block quantizer against DeepSpeed's and a memcpy.

One process, one thread, bf16 input (ZeRO-topo's weights and gradients): encode and
decode of ds_ext's int8 and int4 quantizer, eager and fused by ``torch.compile`` (the
default in ZeRO-topo), side by side with DeepSpeed's pure-torch quantizer (the
``NPUQuantizer`` ZeRO++ falls back to without its CUDA kernels: ``quantize`` for int8,
``swizzle_quant`` for int4, ``dequantize`` for both; it takes fp16, as its hpZ path casts)
and a memcpy of the same tensor (the floor). Also the one-time compile cost a fresh
process pays (inductor's disk cache off) and how many calls pay it back.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable

from ds_ext.bench import median, write_json


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--numel", type=int, default=1 << 22, help="elements per call")
    p.add_argument("--block-size", type=int, default=512)
    p.add_argument("--repeats", type=int, default=21)


def _times(fns: list[Callable[[], Any]], repeats: int) -> list[float]:
    """Median seconds of each function, measured interleaved (one call of each per round),
    so that a change of load on a shared machine hits every variant alike."""
    for fn in fns:
        fn()
    out: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            out[i].append(time.perf_counter() - t0)
    return [median(v) for v in out]


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch._inductor.config as inductor_config

    from ds_ext.comm.quant import BlockQuantizer
    from ds_ext.integration.ds_zeropp_quantizer import deepspeed_cpu_quantizer

    torch.set_num_threads(1)
    inductor_config.fx_graph_cache = False  # measure what a fresh machine pays
    n, block = args.numel, args.block_size
    x = torch.randn(n).to(torch.bfloat16)
    x16 = x.half()
    ds = deepspeed_cpu_quantizer()
    records = []
    for bits in (8, 4):
        eager, fused = BlockQuantizer(bits, block), BlockQuantizer(bits, block, compile=True)
        q = eager.quantize(x)
        t0 = time.perf_counter()
        fused.dequantize(fused.quantize(x), torch.bfloat16)
        compile_s = time.perf_counter() - t0
        if bits == 8:
            ds_encode = lambda: ds.quantize(x16, n // block, 8, 0)  # noqa: E731
        else:
            ds_encode = lambda: ds.swizzle_quant(x16, n // block, 4, 0, 1, 1, 1)  # noqa: E731
        ds_q, ds_scales = ds_encode()
        memcpy, ds_enc, enc_eager, enc = _times(
            [lambda: x.clone(), ds_encode, lambda: eager.quantize(x), lambda: fused.quantize(x)], args.repeats)
        ds_dec, dec_eager, dec = _times(
            [lambda: ds.dequantize(ds_q, ds_scales, n // block, bits, 0), lambda: eager.dequantize(q, torch.bfloat16),
             lambda: fused.dequantize(q, torch.bfloat16)], args.repeats)
        rec = {
            "bits": bits, "numel": n, "block_size": block, "memcpy_s": memcpy,
            "deepspeed_encode_s": ds_enc, "deepspeed_decode_s": ds_dec,
            "encode_eager_s": enc_eager, "encode_s": enc, "decode_eager_s": dec_eager, "decode_s": dec,
            "compile_s": compile_s,
        }
        rec["encode_vs_deepspeed"] = rec["deepspeed_encode_s"] / rec["encode_s"]
        rec["decode_vs_deepspeed"] = rec["deepspeed_decode_s"] / rec["decode_s"]
        rec["encode_vs_eager"] = rec["encode_eager_s"] / rec["encode_s"]
        rec["encode_vs_memcpy"] = rec["encode_s"] / memcpy
        saved = rec["encode_eager_s"] - rec["encode_s"] + rec["decode_eager_s"] - rec["decode_s"]
        rec["calls_to_amortize_compile"] = compile_s / saved if saved > 0 else None
        records.append(rec)
        print(f"int{bits}: encode {rec['encode_s'] * 1e3:.2f} ms ({rec['encode_vs_deepspeed']:.1f}x DeepSpeed's "
              f"{rec['deepspeed_encode_s'] * 1e3:.1f} ms, {rec['encode_vs_memcpy']:.1f}x a memcpy, eager "
              f"{rec['encode_eager_s'] * 1e3:.1f} ms); decode {rec['decode_s'] * 1e3:.2f} ms "
              f"({rec['decode_vs_deepspeed']:.1f}x DeepSpeed's); compile {compile_s:.1f} s once")
    payload = {"benchmark": "quant", "threads": 1, "dtype": "bfloat16", "records": records}
    out = write_json(args.out, payload)
    print(f"wrote {out}")
    return payload
