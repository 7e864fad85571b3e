"""The one base of every section of the ``"ds_ext"`` block (``ds_ext.config`` and each plugin's).

Strict as JSON is: ``"yes"`` is not a bool, ``"512"`` not an integer, ``NaN`` and
``Infinity`` are no numbers; unknown keys are errors; defaults are validated too.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigSection(BaseModel):
    """Base of every ``"ds_ext"`` config section: strict types, finite numbers, no unknown keys."""

    model_config = ConfigDict(extra="forbid", validate_default=True, strict=True, allow_inf_nan=False)
