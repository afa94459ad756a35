"""Server-rendered SVG charts: geometry computed here, markup in templates."""

from __future__ import annotations

import datetime
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import ClassVar

from django.utils.translation import gettext as _

WIDTH = 560
HEIGHT = 180
LEFT = 48
RIGHT = 12
TOP = 12
BOTTOM = 24


@dataclass(frozen=True, slots=True)
class Line:
    label: str
    color: str
    path: str
    dashed: bool = False
    last: str = ""
    #: Each value's point, drawn as a dot (a minute alone has no line to show it).
    dots: tuple[tuple[float, float], ...] = ()


@dataclass(frozen=True, slots=True)
class Tick:
    position: float
    label: str


@dataclass(frozen=True, slots=True)
class Chart:
    title: str
    lines: tuple[Line, ...]
    y_ticks: tuple[Tick, ...]
    x_ticks: tuple[Tick, ...]
    empty: bool
    #: Said on an empty chart (the template's "no data" by default).
    empty_text: str = ""

    # The plot area's geometry, in pixels (the template's too).
    width: ClassVar[int] = WIDTH
    height: ClassVar[int] = HEIGHT
    left: ClassVar[int] = LEFT
    right: ClassVar[int] = WIDTH - RIGHT
    top: ClassVar[int] = TOP


def _nice_ceiling(value: float) -> float:
    if value <= 0:
        return 1.0
    magnitude: float = 10.0 ** math.floor(math.log10(value))
    steps = (step * magnitude for step in (1, 2, 2.5, 5, 10))
    return next((top for top in steps if value <= top), 10 * magnitude)


def line_chart(
    title: str,
    *,
    start: datetime.datetime,
    end: datetime.datetime,
    series: Mapping[str, tuple[str, Mapping[datetime.datetime, float]]],
    limit: tuple[str, float] | None = None,
    value_format: Callable[[float], str] | None = None,
    bucket_s: int = 60,
) -> Chart:
    """Lay out bucketed ``series`` (label -> (color, {time: value})) over ``start..end``.

    The vertical scale runs from 0 to a round number above the values and ``limit``, a
    dashed line (label, value) drawn *under* the series. Buckets without a value leave a
    gap; a legend gives the latest value, written by ``value_format``.
    """
    show = value_format or "{:g}".format
    values = [v for _color, points in series.values() for v in points.values()]
    top_value = max([*values, limit[1] if limit else 0.0, 0.0])
    y_max = _nice_ceiling(top_value * 1.1 if top_value else 1.0)
    plot_w = WIDTH - LEFT - RIGHT
    plot_h = HEIGHT - TOP - BOTTOM
    span = max((end - start).total_seconds(), 1.0)

    def x(at: datetime.datetime) -> float:
        return LEFT + plot_w * min(max((at - start).total_seconds() / span, 0.0), 1.0)

    def y(value: float) -> float:
        return TOP + plot_h * (1 - min(value / y_max, 1.0))

    lines: list[Line] = []
    if limit is not None:
        path = f"M{LEFT} {y(limit[1]):.1f} H{WIDTH - RIGHT}"
        lines.append(Line(limit[0], "#ba2121", path, dashed=True, last=show(limit[1])))
    for label, (color, points) in series.items():
        parts: list[str] = []
        dots: list[tuple[float, float]] = []
        previous: datetime.datetime | None = None
        for at in sorted(points):
            gap = previous is None or (at - previous) > datetime.timedelta(seconds=bucket_s * 1.5)
            dots.append((round(x(at), 1), round(y(points[at]), 1)))
            parts.append(f"{'M' if gap else 'L'}{dots[-1][0]} {dots[-1][1]}")
            previous = at
        last = show(points[max(points)]) if points else ""
        lines.append(Line(label, color, " ".join(parts), last=last, dots=tuple(dots)))
    y_ticks = tuple(Tick(y(y_max * i / 4), show(y_max * i / 4)) for i in range(5))
    x_ticks = tuple(Tick(x(at), label) for at, label in time_ticks(start, end))
    return Chart(title, tuple(lines), y_ticks, x_ticks, empty=not values)


#: Steps between the time axis' labels, in seconds (the first giving few enough).
TIME_STEPS = (10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600)
MAX_TIME_TICKS = 6


def time_ticks(
    start: datetime.datetime, end: datetime.datetime
) -> list[tuple[datetime.datetime, str]]:
    """Labels of the time axis, counted back from ``end`` ("now") in round steps."""
    span = max((end - start).total_seconds(), 1.0)
    step = next((s for s in TIME_STEPS if span / s <= MAX_TIME_TICKS - 1), TIME_STEPS[-1])
    backs = reversed(range(0, math.floor(span) + 1, step))
    return [(end - datetime.timedelta(seconds=back), _ago(back)) for back in backs]


def _ago(seconds: int) -> str:
    """``now``, ``-90 s``, ``-15 min``, ``-2 h``, ``-1.5 h``: whole units only."""
    if seconds == 0:
        return _("now")
    if seconds % 60:
        return f"-{seconds} s"
    if seconds < 3600 or seconds % 1800:
        return f"-{seconds // 60} min"
    return f"-{seconds // 3600} h" if seconds % 3600 == 0 else f"-{seconds / 3600:.1f} h"


@dataclass(frozen=True, slots=True)
class Bar:
    """A horizontal bar: slots held of a limit (a small inline SVG), and a note after it."""

    name: str
    width: int
    height: int
    fill: float
    color: str
    label: str
    note: str = ""


def bar(name: str, active: int, limit: int | None, *, note: str = "", width: int = 120) -> Bar:
    share = 0.0 if not limit else min(active / limit, 1.0)
    color = "#ba2121" if limit and active >= limit else "#417690"
    label = f"{active}/{limit}" if limit else str(active)
    return Bar(name, width, 10, round(width * share, 1), color, label, note)
