"""Figures for the planner's and the benchmarks' PNGs, without pyplot.

A :class:`matplotlib.figure.Figure` with its own Agg canvas: no global backend switch
(``matplotlib.use``) and no pyplot state, so importing or calling ds_ext never changes the
plotting of the program around it. Also: one colour per name across every panel of a figure,
and point labels placed so that none overlaps another.
"""

from __future__ import annotations

import itertools
from typing import Iterable, Sequence

from ds_ext.errors import require_extra

require_extra("matplotlib", "ds_ext's figures (the planner's and the benchmarks' PNGs)")

from matplotlib.axes import Axes  # noqa: E402
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.text import Annotation, Text  # noqa: E402
from matplotlib.transforms import Bbox  # noqa: E402

LABEL_STEP_PT = 9.0  # a moved label goes up by this many points per try


def figure(**kwargs) -> Figure:
    """A figure on its own Agg canvas (``Figure(**kwargs)``); ``fig.savefig`` writes it."""
    fig = Figure(**kwargs)
    FigureCanvasAgg(fig)
    return fig


def colours(names: Iterable[str]) -> dict[str, tuple[float, ...]]:
    """A distinct colour per name (tab10, then tab20 for more than ten), in order."""
    import matplotlib

    names = list(dict.fromkeys(names))
    palette = matplotlib.colormaps["tab10" if len(names) <= 10 else "tab20"].colors
    if len(names) > len(palette):
        raise ValueError(f"{len(names)} names, only {len(palette)} distinct colours")
    return dict(zip(names, palette))


def annotate_apart(
    ax: Axes, labels: Sequence[tuple[str, tuple[float, float]]], fontsize: float = 7
) -> list[Annotation]:
    """Label points so that no two labels overlap: each label starts just above-right of its
    point and moves up until it is clear of the ones placed before (a thin line then joins it to
    its point). Call after the figure's layout is final (``tight_layout``): positions are
    measured on the canvas."""
    renderer = ax.figure.canvas.get_renderer()
    placed: list[Annotation] = []
    taken: list[Bbox] = []
    for text, xy in labels:
        for step in itertools.count():  # ends: high enough, a label clears every other
            note = ax.annotate(
                text,
                xy,
                xytext=(3, 3 + LABEL_STEP_PT * step),
                textcoords="offset points",
                fontsize=fontsize,
                arrowprops=dict(arrowstyle="-", lw=0.4, color="0.5") if step else None,
            )
            note.update_positions(renderer)
            box = Text.get_window_extent(note, renderer)  # the text alone, not its line
            if not any(box.overlaps(other) for other in taken):
                break
            note.remove()
        placed.append(note)
        taken.append(box)
    return placed


def grid_label(grid: Sequence[int]) -> str:
    """A 3D-PMM grid as 'x' 'y' 'z' 'data' degrees: ``4x1x1x2``."""
    return "x".join(map(str, grid))
