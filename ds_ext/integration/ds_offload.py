"""DeepSpeed's own reading of ``zero_optimization.offload_optimizer`` / ``offload_param``.

Touch point (DeepSpeed 0.19.8, ``deepspeed/runtime/zero/config.py``): ``DeepSpeedZeroConfig``, the
pydantic model DeepSpeed builds from the ``zero_optimization`` section (``get_zero_config``), with
its sub-models ``DeepSpeedZeroOffloadOptimizerConfig`` / ``DeepSpeedZeroOffloadParamConfig``
(``offload_config.py``). Reading the section through it accepts exactly what DeepSpeed accepts:
unknown keys refused, ``"auto"`` values dropped, the deprecated ``cpu_offload`` /
``cpu_offload_param`` switches mapped onto the new sections, DeepSpeed's own bounds (``ratio``
below 1 only at stage 3).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ds_ext.errors import DsExtConfigError
from ds_ext.integration.ds_version import check_version

check_version()

# keys of ``zero_optimization`` that ask DeepSpeed for optimizer offload (the deprecated ones included)
OPTIMIZER_OFFLOAD_KEYS = ("offload_optimizer", "cpu_offload", "cpu_offload_use_pin_memory")


@dataclass(frozen=True)
class OffloadSections:
    """The two offload sections as DeepSpeed resolved them.

    ``optimizer`` / ``param``: each field's value (enums as their strings), defaults filled in;
    ``optimizer_set``: the fields the ds_config gave (``"auto"`` ones dropped, as DeepSpeed drops them);
    ``optimizer_defaults``: DeepSpeed's default of each ``offload_optimizer`` field.
    """

    optimizer: dict[str, Any]
    optimizer_set: frozenset[str]
    optimizer_defaults: dict[str, Any]
    param: dict[str, Any]


def _values(section: Any) -> dict[str, Any]:
    out = section.model_dump()
    out["device"] = str(getattr(section.device, "value", section.device))  # a default is a plain string
    return out


def read(zero: Mapping[str, Any]) -> OffloadSections:
    """The offload sections of the ``zero_optimization`` section ``zero``, read by DeepSpeed's model;
    a section DeepSpeed rejects raises one line naming the key."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import (
        DeepSpeedZeroOffloadOptimizerConfig,
        DeepSpeedZeroOffloadParamConfig,
    )
    from pydantic import ValidationError

    try:
        parsed = DeepSpeedZeroConfig(**dict(zero))
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise DsExtConfigError(
            f"zero_optimization{'.' + where if where else ''}: DeepSpeed rejects it ({first['msg']}); "
            f"allowed: what DeepSpeed's zero_optimization model accepts (got {first.get('input')!r})"
        ) from None
    opt = parsed.offload_optimizer or DeepSpeedZeroOffloadOptimizerConfig()
    param = parsed.offload_param or DeepSpeedZeroOffloadParamConfig()
    defaults = {k: f.default for k, f in DeepSpeedZeroOffloadOptimizerConfig.model_fields.items()}
    return OffloadSections(_values(opt), frozenset(opt.model_fields_set), defaults, _values(param))
