"""pydantic schema of the top-level ``"ds_ext"`` block of a ds_config.

DeepSpeed keeps unknown *top-level* keys and rejects unknown keys inside its own
sections, so ds_ext lives in one top-level block::

    "ds_ext": {
      "topology": {"preset": "frontier", "sizes": {"gpu": 2}, "emulate": true},
      "comm": {"ledger": true, "emulate_time": false},
      "<plugin>": {"enabled": true, ...}
    }

Each registered plugin adds its own section (``ds_ext.plugin``). Every error names
the key path and the allowed values, in one line (:class:`DsExtConfigError`).
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any, Literal, Mapping

import hjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, model_validator

from ds_ext.plugin import PluginConfig, registered_configs
from ds_ext.topology import PRESET_NAMES, US, GB, Level

BLOCK = "ds_ext"


class DsExtConfigError(ValueError):
    """An invalid ``"ds_ext"`` block; the message names the key path."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


class LevelConfig(_Section):
    """One level of a generic topology (innermost first)."""

    name: str = Field(description="Link class name, e.g. 'gcd', 'gpu', 'node'.")
    size: int | None = Field(
        None, ge=1, description="Fan-out; omit on the outermost level to infer it from the world size."
    )
    bandwidth_GBps: float = Field(gt=0, description="Per-rank bandwidth of this link class, GB/s.")
    latency_us: float = Field(0.0, ge=0, description="Per-message latency, microseconds.")

    def to_level(self) -> Level:
        return Level(self.name, self.size, self.bandwidth_GBps * GB, self.latency_us * US)


PresetName = Literal[PRESET_NAMES]  # type: ignore[valid-type]


class TopologyConfig(_Section):
    """The machine hierarchy (003 §IV)."""

    preset: PresetName | None = Field(  # type: ignore[valid-type]
        None, description="Named hierarchy. Omit to give 'levels', or to detect one node level from the launcher."
    )
    levels: list[LevelConfig] | None = Field(
        None, description="Generic hierarchy, innermost first (instead of 'preset')."
    )
    sizes: dict[str, int] = Field(
        default_factory=dict, description="Override level sizes by name, e.g. {'gpu': 2}."
    )
    emulate: bool = Field(
        False,
        description="Impose the hierarchy on the ranks by rank order (one host emulating many nodes) "
        "instead of checking it against the launcher's ranks per node.",
    )

    @model_validator(mode="after")
    def _one_source(self) -> "TopologyConfig":
        if self.preset is not None and self.levels is not None:
            raise ValueError("give either 'preset' or 'levels', not both")
        for name, size in self.sizes.items():
            if size < 1:
                raise ValueError(f"sizes.{name} must be >= 1, got {size}")
        return self


class CommConfig(_Section):
    """Ledger and time emulation (``ds_ext.comm``)."""

    ledger: bool = Field(True, description="Record bytes and calls per topology level.")
    count_torch_collectives: bool = Field(
        True,
        description="Also count collectives issued by DeepSpeed and user code through torch.distributed.",
    )
    emulate_time: bool = Field(
        False, description="Hold each collective for its alpha-beta time on the emulated topology."
    )
    time_scale: float = Field(
        1.0, gt=0, description="Multiply emulated times (e.g. 100 to make a slow link visible on CPU)."
    )
    algorithm: Literal["auto", "ring", "pccl", "native"] = Field(
        "native",
        description="All-gather / reduce-scatter algorithm of ds_ext's collectives (001 §6.2; ds_ext.comm.algorithms): "
        "'native' torch.distributed's own, 'ring' the flat ring, 'pccl' recursive doubling/halving across nodes then "
        "a ring inside the node, 'auto' pccl where the alpha-beta model (ds_ext.perf.collectives) predicts it faster than a ring, else 'native'.",
    )
    timeout_s: float = Field(
        1800.0,
        gt=0,
        description="Seconds a collective may wait for a peer before every waiting rank fails with an error that "
        "names this key (torch.distributed's process-group timeout; applies to the world group when ds_ext starts "
        "torch.distributed, and to every group ds_ext creates).",
    )


def _schema_model() -> type[BaseModel]:
    fields: dict[str, Any] = {
        "topology": (TopologyConfig, Field(default_factory=TopologyConfig)),
        "comm": (CommConfig, Field(default_factory=CommConfig)),
    }
    for name, section in registered_configs().items():
        fields[name] = (section, Field(default_factory=section))
    return create_model(
        "DsExtConfig", __config__=ConfigDict(extra="forbid"), **fields
    )


def _allowed_keys(model: type[BaseModel], loc: tuple) -> list[str]:
    """Field names of the sub-model at ``loc`` (for 'unknown key' messages)."""
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part)
        ann = getattr(field, "annotation", None)
        sub = None
        for cand in (ann, *getattr(ann, "__args__", ())):
            for c in (cand, *getattr(cand, "__args__", ())):
                if isinstance(c, type) and issubclass(c, BaseModel):
                    sub = c
        if sub is None:
            return []
        model = sub
    return sorted(model.model_fields)


def _format_error(model: type[BaseModel], err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        path = ".".join([BLOCK, *(str(p) for p in e["loc"])])
        if e["type"] == "extra_forbidden":
            allowed = ", ".join(_allowed_keys(model, e["loc"]))
            lines.append(f"{path}: unknown key; allowed keys: {allowed}")
        else:
            got = e.get("input")
            shown = "" if isinstance(got, (dict, list)) else f" (got {got!r})"
            lines.append(f"{path}: {e['msg']}{shown}")
    return "; ".join(lines)


def parse(block: Mapping[str, Any] | None) -> BaseModel:
    """Validate a ``"ds_ext"`` block; raise :class:`DsExtConfigError` with one line."""
    model = _schema_model()
    if block is None:
        block = {}
    if not isinstance(block, Mapping):
        raise DsExtConfigError(f"{BLOCK}: must be a JSON object, got {type(block).__name__}")
    try:
        return model.model_validate(dict(block))
    except ValidationError as err:
        raise DsExtConfigError(_format_error(model, err)) from None


def load_ds_config(config: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    """A ds_config as a dict, from what ``deepspeed.initialize`` accepts: a dict, a path to a
    JSON (or hjson, as DeepSpeed reads it) file, or a urlsafe-base64 JSON string (GPT-NeoX
    passes ``--deepspeed_config`` that way)."""
    if isinstance(config, Mapping):
        return dict(config)
    path = Path(config)
    try:
        is_file = path.is_file()
    except OSError:  # a base64 config longer than a file name may be
        is_file = False
    if is_file:
        source, text = f"ds_config file {str(path)!r}", path.read_text()
    elif "/" in str(config) or "." in str(config):  # not urlsafe base64: a path
        raise DsExtConfigError(f"ds_config file {str(path)!r} does not exist")
    else:
        try:
            text = base64.urlsafe_b64decode(str(config)).decode("utf-8")
        except (ValueError, UnicodeDecodeError):
            raise DsExtConfigError(
                f"ds_config {str(config)[:60]!r} is neither an existing file nor a base64 JSON string"
            ) from None
        source = "ds_config (base64 string)"
    try:
        data = hjson.loads(text)
    except hjson.HjsonDecodeError as err:
        raise DsExtConfigError(f"{source} is not valid JSON: {err}") from None
    if not isinstance(data, Mapping):
        raise DsExtConfigError(f"{source} must hold a JSON object")
    return json.loads(json.dumps(data))  # plain dicts, as DeepSpeed's own loader gives


def json_schema() -> dict[str, Any]:
    """JSON schema of the ``"ds_ext"`` block with every registered plugin."""
    return _schema_model().model_json_schema()


def plugin_configs(cfg: BaseModel) -> dict[str, PluginConfig]:
    """The plugin sections of a parsed block, by plugin name."""
    return {
        name: getattr(cfg, name)
        for name in type(cfg).model_fields
        if isinstance(getattr(cfg, name), PluginConfig)
    }
