"""How the admin writes ids, counts and times so that a list reads at laptop width.

A list must fit 1280 px, so long values are shortened on screen but never lost: an id
or an error is clipped by CSS, whole in the page and its tooltip; a large count reads
``12.3k`` with the exact figure as its tooltip. Absolute times always carry seconds (a
30 s lease is renewed every 10 s: minutes say nothing), in the active locale's format.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Callable
from typing import Any, cast

from django.contrib import admin
from django.db.models import Field, Model
from django.utils import timezone
from django.utils.formats import date_format, get_format, number_format
from django.utils.html import format_html
from django.utils.translation import gettext as _

from .state import format_ms

#: Counts from here on are written compactly (12.3k).
COMPACT_FROM = 10_000


def with_seconds(fmt: str) -> str:
    """Add seconds to a Django date format that stops at the minute (``P`` becomes
    ``g:i:s a``, ``i`` becomes ``i:s``); escaped letters stay literal."""
    tokens = re.findall(r"\\.?|.", fmt, re.DOTALL)  # an escaped letter is one token
    if "s" in tokens:
        return fmt
    if "P" in tokens:
        tokens[tokens.index("P")] = "g:i:s a"
    elif "i" in tokens:
        tokens[tokens.index("i")] = "i:s"
    return "".join(tokens)


def _local(value: datetime.datetime) -> datetime.datetime:
    return timezone.localtime(value) if timezone.is_aware(value) else value


def timestamp(value: datetime.datetime | None, *, now: datetime.datetime | None = None) -> str:
    """``Dec. 1, 2026, 8:13:05 p.m.``; with ``now`` (database time) followed by
    ``(in 12 s)`` or ``(3 s ago)``."""
    if value is None:
        return "-"
    text = date_format(_local(value), with_seconds(str(get_format("DATETIME_FORMAT"))))
    return text if now is None else f"{text} ({relative(value, now)})"


def short_time(value: datetime.datetime | None) -> str:
    """For a list: the time of day with seconds, its date too unless it is today; the
    full date and time as the tooltip."""
    if value is None:
        return "-"
    local = _local(value)
    text = date_format(local, with_seconds(str(get_format("TIME_FORMAT"))))
    if local.date() != timezone.localdate():
        text = f"{date_format(local, str(get_format('SHORT_DATE_FORMAT')))} {text}"
    return format_html('<span class="runcell-time" title="{}">{}</span>', timestamp(value), text)


def relative(value: datetime.datetime, now: datetime.datetime) -> str:
    """``in 12.0 s`` for a time ahead of ``now``, ``3.2 s ago`` for one behind it."""
    ms = (value - now).total_seconds() * 1000
    if ms >= 0:
        return _("in %(duration)s") % {"duration": format_ms(ms)}
    return _("%(duration)s ago") % {"duration": format_ms(-ms)}


def timestamp_field(
    model: type[Model], name: str, *, now: Callable[[Any], datetime.datetime | None] | None = None
) -> Callable[[Any, Any], str]:
    """A read-only ModelAdmin attribute (named in ``fields``) showing ``model``'s field
    ``name`` with seconds under its own label, and how far from ``now(obj)`` it is."""
    field = cast("Field[Any, Any]", model._meta.get_field(name))

    @admin.display(description=field.verbose_name, ordering=name)
    def show(model_admin: Any, obj: Any) -> str:
        return timestamp(getattr(obj, name), now=now(obj) if now is not None else None)

    return show


def clipped(value: str | None) -> str:
    """``value`` whole in the page and as its tooltip, clipped on screen by CSS."""
    if not value:
        return "-"
    return format_html('<span class="runcell-id" title="{}">{}</span>', value, value)


def task_cell(name: str | None, run_id: str | None) -> str:
    """A task's name (its last dotted part; whole as the tooltip) above its run id."""
    short = (name or "-").rpartition(".")[2] or "-"
    return format_html(
        '<span class="runcell-task-name" title="{}">{}</span><br>{}',
        name or "-",
        short,
        clipped(run_id),
    )


def compact_count(value: int | None) -> str:
    """``9,876`` as the locale groups it; from 10,000 on ``12.3k``, ``4.5M``, with the
    exact figure as the tooltip."""
    if value is None:
        return "-"
    exact = number_format(value, force_grouping=True)
    if abs(value) < COMPACT_FROM:
        return exact
    size, suffix = next(
        (size, suffix)
        for size, suffix in ((1_000_000_000, "G"), (1_000_000, "M"), (1_000, "k"))
        if abs(value) >= size
    )
    short = number_format(round(value / size, 1), decimal_pos=1) + suffix
    return format_html('<span class="runcell-count" title="{}">{}</span>', exact, short)


def count_column(model: type[Model], name: str) -> Callable[[Any], str]:
    """A ``list_display`` entry showing integer field ``name`` with :func:`compact_count`.

    A callable, not a ModelAdmin method: a method named like a model field is never
    called (the admin reads the field first), and another name would rename the
    column's CSS classes."""
    field = cast("Field[Any, Any]", model._meta.get_field(name))

    @admin.display(description=field.verbose_name, ordering=name)
    def show(obj: Any) -> str:
        return compact_count(getattr(obj, name))

    show.__name__ = name
    return show
