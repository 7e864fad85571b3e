"""``deepspeed.moe.layer.MoE`` becomes ``ds_ext.moe.TEDMoE`` when the job's ds_config enables TED.

Megatron-DeepSpeed (``megatron/model/transformer.py``) and most MoE scripts build their layers
through ``deepspeed.moe.layer.MoE(...)`` while the model is constructed, long before
``deepspeed.initialize`` sees the config; the config is known earlier only from the command
line (``--deepspeed_config`` / ``--deepspeed-config``: a path, or GPT-NeoX's base64 string).
When ds_ext is active (``python -m ds_ext.run`` or the autoload path), the script's command
line is read once, and if its ``"ds_ext": {"ted": {"enabled": true}}`` is set,
``deepspeed.moe.layer.MoE`` is replaced by :class:`ds_ext.moe.TEDMoE` (same constructor and
return value, a subclass of DeepSpeed's ``MoE``); DTD and CAC then come from the
``ds_ext.ted`` block when ``deepspeed.initialize`` binds the layers (001 §7.3). A script that
imported ``MoE`` before activation keeps DeepSpeed's class, and the ted plugin then refuses it
by name. DeepSpeed-private touch point: the module attribute it replaces.
"""

from __future__ import annotations

import sys
from typing import Any, Sequence

from ds_ext import log

CONFIG_FLAGS: tuple[str, ...] = ("--deepspeed_config", "--deepspeed-config")


def config_from_argv(argv: Sequence[str]) -> str | None:
    """The value of ``--deepspeed_config`` / ``--deepspeed-config`` in ``argv`` (last wins, as
    argparse does), or None."""
    found = None
    for i, arg in enumerate(argv):
        for flag in CONFIG_FLAGS:
            if arg == flag and i + 1 < len(argv):
                found = argv[i + 1]
            elif arg.startswith(flag + "="):
                found = arg[len(flag) + 1 :]
    return found


def ted_enabled(ds_config: Any) -> bool:
    """Whether a ds_config (dict, path or base64 string) enables ``ds_ext.ted``; a config
    ds_ext cannot read is left to ``deepspeed.initialize`` to report."""
    from ds_ext import config as cfgmod

    try:
        block = cfgmod.load_ds_config(ds_config).get(cfgmod.BLOCK) or {}
    except (cfgmod.DsExtConfigError, OSError):
        return False
    ted = block.get("ted") if isinstance(block, dict) else None
    return isinstance(ted, dict) and ted.get("enabled") is True


def substitute(ds_config: Any) -> bool:
    """Make ``deepspeed.moe.layer.MoE`` TEDMoE if ``ds_config`` enables TED (imports DeepSpeed);
    returns whether it did."""
    if ds_config is None or not ted_enabled(ds_config):
        return False
    import deepspeed.moe.layer as ds_layer

    from ds_ext.integration.ds_version import check_version
    from ds_ext.moe.layer import TEDMoE

    check_version()
    if ds_layer.MoE is not TEDMoE:
        ds_layer.MoE = TEDMoE
        log.info("ds_ext.ted is enabled: deepspeed.moe.layer.MoE is ds_ext.moe.TEDMoE")
    return True


def substitute_from_argv(argv: Sequence[str] | None = None) -> bool:
    """:func:`substitute` with the ds_config named on the command line (``sys.argv``)."""
    return substitute(config_from_argv(sys.argv[1:] if argv is None else argv))
