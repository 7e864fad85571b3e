"""``ds-ext bench quant``: ds_ext's block quantizer against DeepSpeed's and a plain copy.

One process, bf16 input (ZeRO-topo's weights and gradients): encode and decode of ds_ext's
int8 and int4 quantizer, eager and fused (``compile=True``, ZeRO-topo's default: one Triton
kernel per call on a GPU, ``torch.compile`` on the CPU), side by side with DeepSpeed's
quantizer of the same device and a copy of the same tensor (the floor), variants interleaved
round by round. The fused encode is timed on the gradient path (``nonfinite="flag"``: no
host wait) and on the weight path (``"raise"``: one read of the kernel's non-finite flag).

* ``--device cpu`` (one thread): DeepSpeed's pure-torch ``NPUQuantizer``, what ZeRO++ falls
  back to without its CUDA kernels; timed with the wall clock.
* ``--device cuda``: DeepSpeed's CUDA quantizer kernels, the ones ZeRO++ runs
  (``QuantizerBuilder``, built on first use): ``quantize`` (qwZ, int8), ``swizzle_quant``
  (qgZ's int4 encode), ``dequantize``; a device-to-device copy; timed between CUDA events,
  two ways: one call on an idle GPU (its latency, host work included), and ``stream``: K
  calls back to back between the events (K = max(1, 2^24 / elements)), the time per call
  in a busy stream, as a training step issues them.

DeepSpeed's kernels take fp16 (its qwZ path casts bf16 weights first; the cast is not timed).
Also: the one-time compile cost a fresh process pays (inductor's disk cache off), how many
calls pay it back, and each quantizer's worst element error over its block's absmax
(ds_ext: at most 1 / (2 qmax); DeepSpeed's swizzled int4 layout is not decoded in order, so
its int4 error is not reported).
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import time
from typing import Any, Callable

from ds_ext.bench import median, write_json

DEVICES = ("cpu", "cuda")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument(
        "--device",
        choices=DEVICES,
        default="cpu",
        help="cpu: DeepSpeed's pure-torch quantizer; cuda: its CUDA kernels (ZeRO++)",
    )
    p.add_argument(
        "--numel",
        type=int,
        nargs="+",
        default=None,
        help="elements per call, one record each (default: 2^22 on cpu; 2^20, 2^22, 2^24 and 2^28 on "
        "cuda, where up to 2^22 elements take about as long as a kernel launch)",
    )
    p.add_argument("--block-size", type=int, default=512)
    p.add_argument("--repeats", type=int, default=21)
    p.add_argument(
        "--geometry",
        nargs="*",
        default=[],
        metavar="TILE:WARPS",
        help="cuda: also time the Triton kernels alone at the largest size for each launch geometry "
        "(elements per program : warps), beside the default 4096:4",
    )


def _times(fns: list[Callable[[], Any]], repeats: int, device: str, calls: int = 1) -> list[float]:
    """Median seconds per call of each function, measured interleaved (each function once per
    round, the order rotated from round to round), so that a change of load, and whatever the
    previous call leaves behind, hits every variant alike; on CUDA between two events around
    ``calls`` calls, each round synchronised (kernels run asynchronously: the host clock would
    time their launch)."""
    import torch

    for fn in fns:
        fn()
    out: list[list[float]] = [[] for _ in fns]
    for r in range(repeats):
        for j in range(len(fns)):
            i = (j + r) % len(fns)
            fn = fns[i]
            if device == "cpu":
                t0 = time.perf_counter()
                fn()
                out[i].append(time.perf_counter() - t0)
            else:
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(calls):
                    fn()
                end.record()
                end.synchronize()
                out[i].append(start.elapsed_time(end) / 1e3 / calls)
    return [median(v) for v in out]


def _worst_error(x, decoded, block: int) -> float:
    """max |x - x̂| / absmax of x's block, over all blocks (blocks with absmax 0 skipped)."""
    x, d = x.float().view(-1, block), decoded.float().view(-1, block)
    amax = x.abs().amax(dim=1)
    keep = amax > 0
    return float(((x - d).abs().amax(dim=1)[keep] / amax[keep]).max())


def _deepspeed(device: str):
    """(encode(x16, groups, bits), decode(q, scales, groups, bits)) of DeepSpeed's quantizer."""
    if device == "cpu":
        from ds_ext.integration.ds_zeropp_quantizer import deepspeed_cpu_quantizer

        ds = deepspeed_cpu_quantizer()
        sym = 0
    else:
        from ds_ext.integration.ds_zeropp_quantizer import deepspeed_cuda_quantizer

        ds = deepspeed_cuda_quantizer()
        sym = ds.Symmetric

    def encode(x16, groups, bits):
        if bits == 8:
            return ds.quantize(x16, groups, 8, sym)
        return ds.swizzle_quant(x16, groups, 4, sym, 1, 1, 1)

    def decode(q, scales, groups, bits):
        return ds.dequantize(q, scales, groups, bits, sym)

    return encode, decode


def environment(device: str) -> dict[str, Any]:
    """What the numbers were measured on (the README quotes it)."""
    import deepspeed
    import torch

    env: dict[str, Any] = {
        "device": device,
        "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
        "python": platform.python_version(),
    }
    if device == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=False,
        )
        env["driver"] = smi.stdout.strip() or None
    else:
        env["cpu"] = platform.processor() or platform.machine()
        env["threads"] = 1
    return env


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch._inductor.config as inductor_config

    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("ds-ext bench quant --device cuda: no CUDA device is visible")
    if device == "cpu":
        torch.set_num_threads(1)
    inductor_config.fx_graph_cache = False  # measure what a fresh machine pays
    block = args.block_size
    sizes = args.numel or ([1 << 22] if device == "cpu" else [1 << 20, 1 << 22, 1 << 24, 1 << 28])
    for n in sizes:
        if n % block:
            raise SystemExit(f"ds-ext bench quant: --numel {n} must be a multiple of --block-size {block}")
    ds_encode_fn, ds_decode_fn = _deepspeed(device)
    records = [rec for n in sizes for rec in _records(args, device, n, ds_encode_fn, ds_decode_fn)]
    payload = {"benchmark": "quant", "environment": environment(device), "dtype": "bfloat16", "records": records}
    if args.geometry and device == "cuda":
        payload["geometry"] = _geometry(args, max(sizes))
    out = write_json(args.out, payload)
    print(f"wrote {out}")
    return payload


def _geometry(args: argparse.Namespace, n: int) -> list[dict[str, Any]]:
    """The Triton kernels alone (no BlockQuantizer wrapper) at ``n`` elements per launch geometry,
    all geometries interleaved: encode on the gradient path and decode to bf16."""
    import torch

    from ds_ext.comm.quant_triton import TILE_ELEMENTS, TritonQuantKernels

    block = args.block_size
    torch.manual_seed(0)
    x = torch.randn(n, device="cuda").to(torch.bfloat16)
    shapes = [(TILE_ELEMENTS, 4)] + [tuple(int(v) for v in g.split(":")) for g in args.geometry]
    out = []
    for bits in (8, 4):
        kernels = [TritonQuantKernels(bits, block, tile, warps) for tile, warps in shapes]
        encoded = [k.encode(x, n // block, False) for k in kernels]
        target = torch.empty(n, dtype=torch.bfloat16, device="cuda")
        enc = _times([lambda k=k: k.encode(x, n // block, False) for k in kernels], args.repeats, "cuda")
        dec = _times(
            [lambda k=k, e=e: k.decode(e[0], e[1], target) for k, e in zip(kernels, encoded)], args.repeats, "cuda"
        )
        for (tile, warps), e, d in zip(shapes, enc, dec):
            out.append(
                {"bits": bits, "numel": n, "tile_elements": tile, "num_warps": warps, "encode_s": e, "decode_s": d}
            )
            print(
                f"geometry int{bits} x {n}: tile {tile} warps {warps}: encode {e * 1e3:.3f} ms, decode {d * 1e3:.3f} ms"
            )
    return out


def _records(args: argparse.Namespace, device: str, n: int, ds_encode_fn, ds_decode_fn) -> list[dict[str, Any]]:
    """int8 and int4 records of one tensor size (compile cost: measured on the first size only)."""
    import torch

    from ds_ext.comm.quant import BlockQuantizer

    block = args.block_size
    groups = n // block
    torch.manual_seed(0)
    x = torch.randn(n, device=device).to(torch.bfloat16)
    x16 = x.half()

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    records = []
    for bits in (8, 4):
        eager, fused = BlockQuantizer(bits, block), BlockQuantizer(bits, block, compile=True)
        q = eager.quantize(x)
        sync()
        t0 = time.perf_counter()
        fused.dequantize(fused.quantize(x), torch.bfloat16)
        sync()
        compile_s = time.perf_counter() - t0
        ds_encode = lambda: ds_encode_fn(x16, groups, bits)  # noqa: E731
        ds_q, ds_scales = ds_encode()
        encoders = [
            lambda: x.clone(),
            ds_encode,
            lambda: fused.quantize(x, nonfinite="flag"),
            lambda: fused.quantize(x),
        ]
        decoders = [lambda: ds_decode_fn(ds_q, ds_scales, groups, bits), lambda: fused.dequantize(q, torch.bfloat16)]
        # the peers interleaved; ds_ext's eager kernels (many launches, large temporaries) apart,
        # so that what they leave behind does not land on a peer's call
        copy, ds_enc, enc, enc_checked = _times(encoders, args.repeats, device)
        ds_dec, dec = _times(decoders, args.repeats, device)
        enc_eager, dec_eager = _times(
            [lambda: eager.quantize(x), lambda: eager.dequantize(q, torch.bfloat16)], args.repeats, device
        )
        rec = {
            "bits": bits,
            "numel": n,
            "block_size": block,
            "copy_s": copy,
            "deepspeed_encode_s": ds_enc,
            "deepspeed_decode_s": ds_dec,
            "encode_eager_s": enc_eager,
            "encode_s": enc,
            "encode_checked_s": enc_checked,
            "decode_eager_s": dec_eager,
            "decode_s": dec,
            "compile_s": compile_s,
            "error": _worst_error(x, fused.dequantize(fused.quantize(x), torch.float32), block),
            "error_bound": 1 / (2 * eager.qmax),
            "deepspeed_error": (
                _worst_error(x16, ds_decode_fn(ds_q, ds_scales, groups, 8), block) if bits == 8 else None
            ),
        }
        if device == "cuda":  # back to back: the time per call in a busy stream
            calls = max(1, (1 << 24) // n)
            s_copy, s_ds_enc, s_enc, s_enc_checked = _times(encoders, args.repeats, device, calls)
            s_ds_dec, s_dec = _times(decoders, args.repeats, device, calls)
            rec["stream"] = {
                "calls": calls,
                "copy_s": s_copy,
                "deepspeed_encode_s": s_ds_enc,
                "encode_s": s_enc,
                "encode_checked_s": s_enc_checked,
                "deepspeed_decode_s": s_ds_dec,
                "decode_s": s_dec,
                "encode_vs_deepspeed": s_ds_enc / s_enc,
                "decode_vs_deepspeed": s_ds_dec / s_dec,
            }
        rec["encode_vs_deepspeed"] = rec["deepspeed_encode_s"] / rec["encode_s"]
        rec["encode_checked_vs_deepspeed"] = rec["deepspeed_encode_s"] / rec["encode_checked_s"]
        rec["decode_vs_deepspeed"] = rec["deepspeed_decode_s"] / rec["decode_s"]
        rec["encode_vs_eager"] = rec["encode_eager_s"] / rec["encode_s"]
        rec["encode_vs_copy"] = rec["encode_s"] / copy
        rec["decode_vs_copy"] = rec["decode_s"] / copy
        saved = rec["encode_eager_s"] - rec["encode_s"] + rec["decode_eager_s"] - rec["decode_s"]
        rec["calls_to_amortize_compile"] = compile_s / saved if saved > 0 else None
        records.append(rec)
        print(
            f"int{bits} x {n}: encode {rec['encode_s'] * 1e3:.3f} ms ({rec['encode_vs_deepspeed']:.2f}x DeepSpeed's "
            f"{rec['deepspeed_encode_s'] * 1e3:.3f} ms, {rec['encode_vs_copy']:.2f}x a copy, eager "
            f"{rec['encode_eager_s'] * 1e3:.3f} ms, checked {rec['encode_checked_vs_deepspeed']:.2f}x); decode "
            f"{rec['decode_s'] * 1e3:.3f} ms ({rec['decode_vs_deepspeed']:.2f}x DeepSpeed's); compile "
            f"{compile_s:.1f} s once"
            + (
                f"; stream x{rec['stream']['calls']}: encode "
                f"{rec['stream']['encode_vs_deepspeed']:.2f}x, decode "
                f"{rec['stream']['decode_vs_deepspeed']:.2f}x"
                if "stream" in rec
                else ""
            )
        )
    return records
