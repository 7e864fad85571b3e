"""DeepSpeed ZeRO-3 state accounting (benchmarks; attribute names of DeepSpeed 0.19.8).

Behind the version gate of :mod:`ds_ext.integration.ds_version`.
"""

from __future__ import annotations

from ds_ext.integration.ds_version import check_version

check_version()


def deepspeed_zero3_state_bytes(engine) -> dict[str, int]:
    """Bytes one rank holds per model state under DeepSpeed's ZeRO-3 optimizer (0.19.8
    attribute names): ``ds_tensor`` / ``ds_secondary_tensor`` partitions, the flat gradient
    partition buffer, fp32 master partitions plus the inner optimizer's state."""
    opt = engine.optimizer
    nbytes = lambda t: 0 if t is None else t.numel() * t.element_size()  # noqa: E731
    params = list(engine.module.parameters())
    inner = sum(nbytes(v) for st in opt.optimizer.state.values() for v in st.values() if getattr(v, "dim", lambda: 0)())
    return {
        "primary": sum(nbytes(p.ds_tensor) for p in params),
        "secondary": sum(nbytes(getattr(p, "ds_secondary_tensor", None)) for p in params),
        "gradients": nbytes(opt.grad_partitions_flat_buffer),
        "optimizer": sum(nbytes(t) for t in opt.fp32_partitioned_groups_flat) + inner,
    }
