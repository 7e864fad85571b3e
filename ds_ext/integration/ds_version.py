"""The one version gate in front of every DeepSpeed-private touch point.

DeepSpeed has no plugin hooks (spec/deepspeed_on_cpu.md §3.8), so ds_ext reaches a few
private names, each in the module of the DeepSpeed surface it touches:

* :mod:`ds_ext.integration.ds_engine`: engine, launcher and checkpoint hooks;
* :mod:`ds_ext.integration.ds_zero12_step`: the forked ZeRO-1/2 and unfused fp16 steps
  (tiled optimizer), one mirror per tested release (0.19.6, 0.19.8), refused unless
  DeepSpeed's source is one of those they were forked from;
* :mod:`ds_ext.integration.ds_offload`: DeepSpeed's model of the ``zero_optimization`` section
  (its offload sections, read as DeepSpeed reads them);
* :mod:`ds_ext.integration.ds_zero3_state`: ZeRO-3 state accounting (benchmarks);
* :mod:`ds_ext.integration.ds_zeropp_quantizer`: ZeRO++'s quantizer on CPU (benchmarks);
* :mod:`ds_ext.integration.ds_pccl`: the backend's all-gather / reduce-scatter functions (PCCL routing).

Each of them calls :func:`check_version` when imported. The names were read in
DeepSpeed 0.19.8.
"""

from __future__ import annotations

import hashlib
import inspect

from packaging.version import Version

from ds_ext.errors import DsExtError

SUPPORTED = (Version("0.19.0"), Version("0.20.0"))  # [min, max)


class DeepSpeedVersionError(DsExtError, RuntimeError):
    """The installed DeepSpeed is not one ds_ext's private touch points were written for."""


def check_version() -> str:
    """Return DeepSpeed's version, or raise if ds_ext does not support it."""
    import deepspeed

    v = Version(deepspeed.__version__.split("+")[0])
    lo, hi = SUPPORTED
    if not lo <= v < hi:
        raise DeepSpeedVersionError(f"ds_ext supports deepspeed>={lo},<{hi}; found deepspeed {deepspeed.__version__}")
    return deepspeed.__version__


def source_digest(obj: object) -> str:
    """sha256 of ``obj``'s Python source."""
    return hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()  # type: ignore[arg-type]


def forked_release(obj: object, digests: dict[str, str], what: str) -> str:
    """The DeepSpeed release whose source of ``obj`` ds_ext forked and tested, found by digest.

    ``digests`` maps each tested release to the sha256 of ``obj``'s source in it; a source
    that matches none of them is refused, since a silently stale fork would train wrongly.
    """
    import deepspeed

    found = source_digest(obj)
    for release, digest in digests.items():
        if found == digest:
            return release
    name = getattr(obj, "__qualname__", repr(obj))
    tested = ", ".join(f"deepspeed=={r}" for r in digests)
    raise DeepSpeedVersionError(
        f"{what}: deepspeed {deepspeed.__version__}'s {name} matches none of the DeepSpeed sources "
        f"ds_ext's forked steps mirror (sha256 {found[:12]}); tested releases: {tested}; use one of them "
        "or switch the feature off"
    )
