"""``ds-ext bench quant``: the block quantizer, eager against ``torch.compile``.

Times ``BlockQuantizer(compile=False)`` against ``BlockQuantizer(compile=True)`` (the same
encode / decode bodies fused by ``torch.compile``), int8 and int4, 1 thread, bf16 input as
ZeRO-topo's weights and gradients are, plus the compile time a fresh process pays (graph
cache off) and the number of calls that pays it back.
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
    p.add_argument("--repeats", type=int, default=7)


def _time(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return median(out)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch._inductor.config as inductor_config

    from ds_ext.comm.quant import BlockQuantizer

    torch.set_num_threads(1)
    inductor_config.fx_graph_cache = False  # measure what a fresh machine pays
    x = torch.randn(args.numel).to(torch.bfloat16)
    records = []
    for bits in (8, 4):
        qz = BlockQuantizer(bits, args.block_size)
        qc = BlockQuantizer(bits, args.block_size, compile=True)
        q = qz.quantize(x)
        t0 = time.perf_counter()
        qc.quantize(x)
        qc.dequantize(q, torch.bfloat16)
        compile_s = time.perf_counter() - t0
        rec = {
            "bits": bits,
            "numel": args.numel,
            "block_size": args.block_size,
            "quantize_eager_s": _time(lambda: qz.quantize(x), args.repeats),
            "quantize_compiled_s": _time(lambda: qc.quantize(x), args.repeats),
            "dequantize_eager_s": _time(lambda: qz.dequantize(q, torch.bfloat16), args.repeats),
            "dequantize_compiled_s": _time(lambda: qc.dequantize(q, torch.bfloat16), args.repeats),
            "compile_s": compile_s,
        }
        rec["quantize_speedup"] = rec["quantize_eager_s"] / rec["quantize_compiled_s"]
        rec["dequantize_speedup"] = rec["dequantize_eager_s"] / rec["dequantize_compiled_s"]
        saved = (rec["quantize_eager_s"] - rec["quantize_compiled_s"]
                 + rec["dequantize_eager_s"] - rec["dequantize_compiled_s"])
        rec["calls_to_amortize_compile"] = compile_s / saved if saved > 0 else None
        records.append(rec)
        print(f"int{bits}: quantize {rec['quantize_eager_s'] * 1e3:.1f} ms eager, "
              f"{rec['quantize_compiled_s'] * 1e3:.1f} ms compiled ({rec['quantize_speedup']:.2f}x); "
              f"dequantize {rec['dequantize_eager_s'] * 1e3:.1f} / {rec['dequantize_compiled_s'] * 1e3:.1f} ms "
              f"({rec['dequantize_speedup']:.2f}x); compile {compile_s:.1f} s")
    payload = {"benchmark": "quant", "records": records}
    out = write_json(args.out, payload)
    print(f"wrote {out}")
    return payload
