"""Frontier's compute rate for a training step, derived from 000's measured compute time.

The planner's step time is ``compute + communication`` (``ds_ext.planner.estimate``), so the
compute term wants the rate at which a GCD runs a whole step's computation. That covers the
matmuls at their real shapes, attention, norms, activations and the checkpoint recompute. One
square GEMM (000 §VI-C: 125 Tflop/s for bf16 32768², 65 % of the 191.5 peak) is only an upper
bound for it.

000 publishes one such time. §V-C (BLAS kernel tuning) says that for GPT-320B, tuning "reduc[ed]
the total time spent in computation from 30.1 seconds to 13.19s". 000 times computation apart from
communication (§VII-A: "breakdowns of the time per batch into computation and non-overlapped
communication"). 000 reports one GPT-320B run on Frontier, Table III's 32,768
GCDs, and the time is read as that run's (000 does not name the GCD count beside it). Its batch is
16.8M tokens = 8,192 sequences of 2,048 (Table I), its shape Table II
(96 layers, hidden 16,384). Activation checkpointing is on (§VI-A), and FLOPs are counted with
Narayanan et al.'s formula (§VI-C), ``ds_ext.perf.compute.step_flops`` with c = 4::

    rate = F(GPT-320B, 8,192 sequences) / 32,768 GCDs / 13.19 s = 98.2 Tflop/s per GCD
         = 0.513 of the 191.5 peak = 0.786 of the single-GEMM 125

The untuned time (30.1 s: PyTorch's default TN matmul at 6 % of the peak, §V-C) gives 43.0
Tflop/s. That is a sensitivity reading for frameworks without matmul tuning (Megatron-DeepSpeed,
004). 000 says tuning gained only 2-4 % for its models up to hidden 12,288 (§VII-A, Fig 7).

None of the planner's validation rows is this run (``ds_ext.planner.validate``). 000 Table III's
rows there stop at GPT-80B on 8,192 GCDs, and 004 Table V and 001 Fig 6.12 are other runs.
"""

from __future__ import annotations

from ds_ext.perf.compute import step_flops
from ds_ext.planner import hardware

PEAK_FLOPS = hardware.value("peak_flops")  # 16-bit peak per GCD (000 §VI-C, 004 §V-B)
GEMM_FLOPS = hardware.value("gemm_flops")  # best bf16 GEMM on one GCD, 32768^2 (000 §VI-C)
RUN_GCDS = 32_768  # 000 Table III: GPT-320B on Frontier
RUN_BATCH = 8_192  # 000 Table I: 16.8M tokens per batch = 8,192 x 2,048
RUN_SHAPE = (96, 16_384, 2_048, 50_304)  # 000 Table II layers, hidden; sequence 2,048; LitGPT's padded GPT-2 vocabulary
TUNED_S = hardware.value("tuned_step_s")  # 000 §V-C: computation per batch with BLAS kernel tuning
UNTUNED_S = hardware.value("untuned_step_s")  # 000 §V-C: the same without it


def rate(compute_s: float = TUNED_S) -> float:
    """Flop/s per GCD of the 000 run's computation taking ``compute_s`` seconds per batch."""
    layers, hidden, seq, vocab = RUN_SHAPE
    return step_flops(RUN_BATCH, seq, layers, hidden, vocab, checkpointing=True) / RUN_GCDS / compute_s


STEP_EFFICIENCY = rate() / PEAK_FLOPS  # the planner's compute efficiency (Frontier preset)
UNTUNED_EFFICIENCY = rate(UNTUNED_S) / PEAK_FLOPS
GEMM_EFFICIENCY = GEMM_FLOPS / PEAK_FLOPS  # the earlier constant, shown as a sensitivity row


def markdown() -> str:
    """The derivation's one line for the README."""
    return (
        f"rate = F(GPT-320B, {RUN_BATCH:,} sequences) / {RUN_GCDS:,} GCDs / {TUNED_S} s = "
        f"{rate() / 1e12:.1f} Tflop/s per GCD = {STEP_EFFICIENCY:.3f} of the peak "
        f"({rate() / GEMM_FLOPS:.3f} of the single GEMM); untuned ({UNTUNED_S} s): "
        f"{rate(UNTUNED_S) / 1e12:.1f} Tflop/s"
    )
