"""A ds_ext plugin written outside the library (docs/adding-a-plugin.md): one module, one section.

``"ds_ext": {"step_clock": {"enabled": true, "every": 10}}`` times each optimizer step the engine
takes (``engine.step`` at the gradient-accumulation boundary) and logs the mean of the last
``every`` steps on rank 0. Import this module before ``ds_ext.initialize``: registering adds its
section to the ``"ds_ext"`` block, so its keys are checked as every built-in's are.
"""

from __future__ import annotations

import functools
import time
from typing import Any

from pydantic import Field

from ds_ext import log
from ds_ext.plugin import Plugin, PluginConfig, register_plugin


class StepClockConfig(PluginConfig):
    """``"ds_ext": {"step_clock": {...}}``."""

    every: int = Field(10, ge=1, description="Log the mean time of every this many optimizer steps.")


@register_plugin
class StepClock(Plugin):
    """Wraps ``engine.step`` at ``attach``; ``seconds`` holds each optimizer step's wall time."""

    name = "step_clock"
    Config = StepClockConfig

    def attach(self, engine: Any) -> None:
        step = engine.step
        self.seconds: list[float] = []

        @functools.wraps(step)
        def timed_step(*args: Any, **kwargs: Any) -> Any:
            boundary = engine.is_gradient_accumulation_boundary()
            start = time.perf_counter()
            out = step(*args, **kwargs)
            if boundary:
                self.seconds.append(time.perf_counter() - start)
                if len(self.seconds) % self.config.every == 0:
                    last = self.seconds[-self.config.every :]
                    log.info(f"step_clock: {len(self.seconds)} steps, mean {sum(last) / len(last):.3f} s")
            return out

        engine.step = timed_step

    def describe(self) -> str:
        return f"each optimizer step timed, the mean of every {self.config.every} logged"
