"""Why a queued request waits, in the words of the allocation rules.

The rules live in :mod:`runcell_celery.allocation`; this module decides nothing. It
reads a limiter row's stored limits and live counts (kept on ``runcell_limiter`` by
every change) and asks allocation's own :func:`~runcell_celery.allocation.has_room`
and :meth:`~runcell_celery.LimiterConfig.ceiling` which rule holds a workload's line
back, then says it: behind others in line, its workload at its ceiling, slots other
workloads reserve, the limit itself, or a workload of higher priority served first.
Everything comes from rows the page already fetched: no query of its own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from django.utils.translation import gettext as _
from django.utils.translation import ngettext

from runcell_celery import LimiterConfig
from runcell_celery.allocation import has_room

__all__ = ["BEHIND", "CEILING", "LIMIT", "NEXT", "PRIORITY", "RESERVED", "Reason", "why_it_waits"]

#: Reason codes (a page's ``data-reason``): what holds the line back.
BEHIND = "behind"
CEILING = "ceiling"
RESERVED = "reservation"
LIMIT = "limit"
PRIORITY = "priority"
NEXT = "next"
UNKNOWN = "unknown-workload"


@dataclass(frozen=True, slots=True)
class Reason:
    """Why a request (or a workload's line) waits: ``code`` for machines, ``text``
    for people."""

    code: str
    text: str


def counts(names: Sequence[str] | None, values: Sequence[int] | None) -> dict[str, int]:
    """Per workload, from a limiter row's arrays (``workloads`` with ``active`` or
    ``waiting``)."""
    return {name: int(n) for name, n in zip(names or (), values or (), strict=False) if n}


def why_it_waits(
    config: LimiterConfig,
    active: Mapping[str, int],
    waiting: Mapping[str, int],
    workload: str,
    *,
    ahead: int = 0,
) -> Reason:
    """Say why a request of ``workload`` with ``ahead`` requests before it in its
    workload's line is not granted now.

    :param active: slots held per workload now.
    :param waiting: requests waiting (or parked) per workload now.
    """
    head = _why_the_head_waits(config, active, waiting, workload)
    if not ahead:
        return head
    behind = ngettext("%(n)d ahead in line", "%(n)d ahead in line", ahead) % {"n": ahead}
    if head.code == NEXT:
        return Reason(BEHIND, behind)
    return Reason(BEHIND, f"{behind} · {head.text}")


def _why_the_head_waits(
    config: LimiterConfig,
    active: Mapping[str, int],
    waiting: Mapping[str, int],
    workload: str,
) -> Reason:
    settings = config.workloads.get(workload)
    if settings is None:
        return Reason(UNKNOWN, _("no workload %(name)s in the stored limits") % {"name": workload})
    held = active.get(workload, 0)
    ceiling = config.ceiling(workload)
    if held >= ceiling and ceiling < config.max_concurrent:  # else the limit is said
        text = _("workload at its ceiling (%(held)d/%(ceiling)d)")
        return Reason(CEILING, text % {"held": held, "ceiling": ceiling})
    if not has_room(config, active, workload):
        total = sum(active.values())
        if total >= config.max_concurrent:
            return Reason(
                LIMIT,
                _("limit reached (%(held)d/%(limit)d)")
                % {"held": total, "limit": config.max_concurrent},
            )
        kept = {
            name: other.reserved - active.get(name, 0)
            for name, other in sorted(config.workloads.items())
            if name != workload and other.reserved > active.get(name, 0)
        }
        parts = ", ".join(f"{name} {n}" for name, n in kept.items())
        return Reason(RESERVED, _("free slots reserved for %(others)s") % {"others": parts})
    first = _served_first(config, active, waiting, workload)
    if first is not None:
        return Reason(PRIORITY, _("%(other)s has priority") % {"other": first})
    return Reason(NEXT, _("granted next"))


def _served_first(
    config: LimiterConfig, active: Mapping[str, int], waiting: Mapping[str, int], workload: str
) -> str | None:
    """A workload of higher priority with requests waiting and room: allocation serves
    it first (:func:`runcell_celery.allocation.allocate`)."""
    mine = config.workloads[workload].priority
    for name, other in sorted(config.workloads.items(), key=lambda item: -item[1].priority):
        if other.priority <= mine:
            return None
        if name != workload and waiting.get(name, 0) and has_room(config, active, name):
            return name
    return None
