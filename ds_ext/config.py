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
from types import UnionType
from typing import Any, Literal, Mapping, Union, get_args, get_origin

import hjson
from pydantic import BaseModel, Field, ValidationError, ValidationInfo, create_model, field_validator, model_validator

from ds_ext.config_base import ConfigSection
from ds_ext.errors import DsExtConfigError, DsExtError
from ds_ext.goldfish.config import GoldfishConfig
from ds_ext.moe.config import TEDConfig
from ds_ext.optim.config import TiledOptimizerConfig
from ds_ext.pccl.config import PCCLConfig
from ds_ext.plugin import PluginConfig, PluginError, registered_plugins
from ds_ext.pmm.config import Pmm3dConfig
from ds_ext.samo.config import SamoConfig
from ds_ext.topology import DETECTED_LEVELS, GB, PRESET_NAMES, US, Level, preset_levels
from ds_ext.zero_topo.plan import ZeroTopoConfig

BLOCK = "ds_ext"

# The built-in plugins' sections, from modules that import no torch (``ds-ext schema``, the
# planner): one line per built-in plugin (its class is listed in ``ds_ext.runtime.builtin_plugins``).
BUILTIN_SECTIONS: dict[str, type[PluginConfig]] = {
    "zero_topo": ZeroTopoConfig,
    "tiled_optimizer": TiledOptimizerConfig,
    "pmm3d": Pmm3dConfig,
    "ted": TEDConfig,
    "pccl": PCCLConfig,
    "goldfish": GoldfishConfig,
    "samo": SamoConfig,
}


def plugin_sections() -> dict[str, type[PluginConfig]]:
    """Name -> section of every plugin: the built-ins', then those of the plugins registered with
    :func:`ds_ext.plugin.register_plugin`; a registered plugin may not take a built-in's name."""
    out = dict(BUILTIN_SECTIONS)
    for name, plugin in registered_plugins().items():
        if name in out:
            raise PluginError(f"plugin name {name!r} is a built-in ds_ext plugin's ({plugin.__module__} registers it)")
        out[name] = plugin.Config
    return out


class ConfigNotFoundError(DsExtConfigError):
    """A ds_config string that is neither an existing file nor base64 JSON."""


class KeyPathError(DsExtError, ValueError):
    """Raised by a validator about one key below the field it validates (``key``), so the
    message names the full key path (e.g. ``ds_ext.topology.sizes.gpux``)."""

    def __init__(self, key: str | int, message: str) -> None:
        super().__init__(message)
        self.key = key


class LevelConfig(ConfigSection):
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


class TopologyConfig(ConfigSection):
    """The machine hierarchy (003 §IV)."""

    preset: PresetName | None = Field(  # type: ignore[valid-type]
        None, description="Named hierarchy. Omit to give 'levels', or to detect one node level from the launcher."
    )
    levels: list[LevelConfig] | None = Field(
        None, description="Generic hierarchy, innermost first (instead of 'preset')."
    )
    sizes: dict[str, int] = Field(default_factory=dict, description="Override level sizes by name, e.g. {'gpu': 2}.")
    emulate: bool = Field(
        False,
        description="Impose the hierarchy on the ranks by rank order (one host emulating many nodes) "
        "instead of checking it against the launcher's ranks per node.",
    )

    @field_validator("sizes")
    @classmethod
    def _known_levels(cls, sizes: dict[str, int], info: ValidationInfo) -> dict[str, int]:
        if "preset" not in info.data or "levels" not in info.data:
            return sizes  # their own error is reported; the level names are unknown
        preset, levels = info.data["preset"], info.data["levels"]
        if levels is not None:
            names, source = [lv.name for lv in levels], "the given levels"
        elif preset is not None:
            names, source = [lv.name for lv in preset_levels(preset)], f"preset {preset!r}"
        else:
            names, source = [lv.name for lv in DETECTED_LEVELS], "the detected topology"
        for name, size in sizes.items():
            if name not in names:
                raise KeyPathError(name, f"unknown level; levels of {source}: {', '.join(names)}")
            if size < 1:
                raise KeyPathError(name, f"must be >= 1 (got {size})")
        return sizes

    @model_validator(mode="after")
    def _one_source(self) -> "TopologyConfig":
        if self.preset is not None and self.levels is not None:
            raise ValueError("give either 'preset' or 'levels', not both")
        return self


class CommConfig(ConfigSection):
    """Ledger and time emulation (``ds_ext.comm``)."""

    ledger: bool = Field(True, description="Record bytes and calls per topology level.")
    count_torch_collectives: bool = Field(
        True,
        description="Also count collectives issued by DeepSpeed and user code through torch.distributed.",
    )
    torch_gloo_reduce_scatter: Literal["native", "all_to_all"] = Field(
        "native",
        description="How a torch.distributed reduce_scatter_tensor of DeepSpeed or user code runs on a gloo group "
        "(counted with count_torch_collectives): 'native' is gloo's own, an all-reduce of the whole input that keeps "
        "one chunk (twice a reduce-scatter's bytes); 'all_to_all' sends each chunk to its owner, which reduces it, as "
        "ds_ext's own reduce-scatter on gloo does and as NCCL / RCCL send (ds-ext bench's fair baseline). The default "
        "leaves the third-party collective as it is.",
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

    @model_validator(mode="after")
    def _reroute_needs_counting(self) -> "CommConfig":
        if self.torch_gloo_reduce_scatter == "all_to_all" and not (self.ledger and self.count_torch_collectives):
            raise ValueError(
                "torch_gloo_reduce_scatter 'all_to_all' runs through the counting wrappers of torch.distributed: "
                "it needs ledger and count_torch_collectives true; allowed otherwise: 'native'"
            )
        return self


def _schema_model() -> type[BaseModel]:
    fields: dict[str, Any] = {
        "topology": (TopologyConfig, Field(default_factory=TopologyConfig)),
        "comm": (CommConfig, Field(default_factory=CommConfig)),
    }
    for name, section in plugin_sections().items():
        fields[name] = (section, Field(default_factory=section))
    return create_model("DsExtConfig", __base__=ConfigSection, **fields)


def _members(annotation: Any) -> list[Any]:
    """The non-None members of a union annotation, else ``[annotation]``."""
    if get_origin(annotation) in (Union, UnionType):
        return [a for a in get_args(annotation) if a is not type(None)]
    return [annotation]


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _key_path(model: type[BaseModel], loc: tuple) -> tuple[list[str], type[BaseModel] | None, Any]:
    """The user's key path of a pydantic error location, without the tags pydantic puts in for
    union members (``GridConfig``, ``list[str]``, ``literal['auto']``); the section that holds
    the path's last key (None if it is not a section); the annotation the location ends in."""
    path: list[str] = []
    owner: type[BaseModel] | None = None
    annotation: Any = model
    for part in loc:
        members = _members(annotation)
        if len(members) > 1:  # ``part`` tags the member that failed: a section's name, 'list[str]', ...
            annotation = next(
                (
                    m
                    for m in members
                    if (_is_model(m) and m.__name__ == part)
                    or (get_origin(m) in (list, dict) and str(part).startswith(f"{get_origin(m).__name__}["))
                ),
                None,
            )
            continue
        annotation = members[0]
        path.append(str(part))
        if _is_model(annotation):
            owner = annotation
            field = annotation.model_fields.get(part)
            annotation = field.annotation if field is not None else None
        else:
            owner = None
            args = get_args(annotation) if get_origin(annotation) in (list, dict) else ()
            annotation = args[-1] if args else None
    return path, owner, annotation


def _message(e: Mapping[str, Any]) -> tuple[str, str]:
    """(extra key, message) of one pydantic error, without pydantic's 'Value error, ' prefix."""
    error = (e.get("ctx") or {}).get("error")
    if isinstance(error, KeyPathError):
        return str(error.key), str(error)
    if isinstance(error, Exception):
        return "", str(error)
    got = e.get("input")
    shown = "" if isinstance(got, (dict, list)) else f" (got {got!r})"
    return "", f"{e['msg']}{shown}"


def _format_error(model: type[BaseModel], err: ValidationError) -> str:
    """One line per problem, joined by '; ': the key path and what is allowed. A value that
    fits no member of a union gives one line with every member's requirement."""
    found: dict[str, list[str]] = {}
    for e in err.errors():
        path, owner, annotation = _key_path(model, e["loc"])
        if e["type"] == "extra_forbidden":
            allowed = ", ".join(sorted(owner.model_fields)) if owner is not None else ""
            key, text = "", f"unknown key; allowed keys: {allowed}"
        elif e["type"] == "model_type" and _is_model(annotation):
            got = e.get("input")
            key, text = (
                "",
                f"Input should be an object with keys {', '.join(sorted(annotation.model_fields))} (got {got!r})",
            )
        else:
            key, text = _message(e)
        found.setdefault(".".join([BLOCK, *path, *([key] if key else [])]), []).append(text)
    deepest = {p: m for p, m in found.items() if not any(q.startswith(p + ".") for q in found)}
    return "; ".join(f"{p}: {_either(m)}" for p, m in deepest.items())


def _either(messages: list[str]) -> str:
    """'Input should be a valid list (got 'x')' and "Input should be 'auto' (got 'x')" ->
    "Input should be a valid list or 'auto' (got 'x')"."""
    if len(messages) == 1:
        return messages[0]
    prefix, got = "Input should be ", None
    wants = []
    for m in messages:
        body, _, tail = m.partition(" (got ")
        got = got or tail
        wants.append(body.removeprefix(prefix))
    return prefix + " or ".join(dict.fromkeys(wants)) + (f" (got {got}" if got else "")


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
    JSON (or hjson, as DeepSpeed reads it) file, or a base64 JSON string (GPT-NeoX passes
    ``--deepspeed_config`` that way; DeepSpeed's decoder takes both alphabets). Duplicate keys
    are refused (DeepSpeed refuses them in a file), so are NaN / Infinity and an empty file."""
    if isinstance(config, Mapping):
        return dict(config)
    path = Path(config)
    try:
        exists, is_dir = path.exists(), path.is_dir()
    except OSError:  # a base64 config longer than a file name may be
        exists = is_dir = False
    if is_dir:
        raise DsExtConfigError(
            f"ds_config {str(path)!r} is a directory; allowed: a JSON file, a dict or a base64 JSON string"
        )
    if exists:
        source, text = f"ds_config file {str(path)!r}", path.read_text()
        if not text.strip():
            raise DsExtConfigError(f"{source} is empty; allowed: a JSON object")
    else:
        source, text = "ds_config (base64 string)", _base64_text(str(config))
    data = _parse_json(text, source)
    if not isinstance(data, Mapping):
        raise DsExtConfigError(f"{source} must hold a JSON object, got {type(data).__name__}")
    return data


def _base64_text(config: str) -> str:
    """The JSON text of a base64 ds_config (either alphabet), as DeepSpeed decodes it."""
    try:
        text = base64.urlsafe_b64decode(config).decode("utf-8")
    except (ValueError, UnicodeDecodeError):
        text = ""
    if text.lstrip().startswith("{"):
        return text
    if "/" in config or config.endswith((".json", ".hjson", ".yml", ".yaml")):
        raise ConfigNotFoundError(f"ds_config file {config!r} does not exist")
    raise ConfigNotFoundError(f"ds_config {config[:60]!r} is neither an existing file nor a base64 JSON object")


class _NotJson(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _NotJson(f"duplicate key {key!r}")
        out[key] = value
    return out


def _no_constant(name: str) -> float:
    raise _NotJson(f"{name} is not a JSON number; allowed: a finite number")


def _parse_json(text: str, source: str) -> Any:
    """JSON, else hjson (as DeepSpeed reads a file): plain dicts, duplicate keys and NaN /
    Infinity refused with one line."""
    try:
        return json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_no_constant)
    except _NotJson as err:
        raise DsExtConfigError(f"{source}: {err}") from None
    except json.JSONDecodeError:
        pass
    try:
        return json.loads(json.dumps(hjson.loads(text, object_pairs_hook=_unique_keys)))
    except _NotJson as err:
        raise DsExtConfigError(f"{source}: {err}") from None
    except hjson.HjsonDecodeError as err:
        raise DsExtConfigError(f"{source} is not valid JSON: {err}") from None


def json_schema() -> dict[str, Any]:
    """JSON schema of the ``"ds_ext"`` block with every registered plugin."""
    return _schema_model().model_json_schema()


def plugin_configs(cfg: BaseModel) -> dict[str, PluginConfig]:
    """The plugin sections of a parsed block, by plugin name."""
    return {name: getattr(cfg, name) for name in type(cfg).model_fields if isinstance(getattr(cfg, name), PluginConfig)}
