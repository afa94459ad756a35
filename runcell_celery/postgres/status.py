"""Every limiter's state for an operator: slots held against the limit, requests queued
and parked, waits; as values, as a table (``celery runcell status``, ``manage.py
runcell_status``) and as JSON.

Read in a few bounded queries through any :data:`~.connection.Rows` (the backend's
pool, or Django's connection for the management command): the counts kept on the
limiter rows (:data:`~.gauges.WORKLOAD_GAUGES`, keys summed under their keyed limiter),
the stored limits, and the p95 wait from the ``acquired`` events when the database has
runcell_django's ``runcell_event``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from . import statements
from .connection import Rows
from .gauges import WORKLOAD_GAUGES, gauges_from_rows

__all__ = [
    "COLUMNS",
    "P95_WINDOW_MINUTES",
    "LimiterStatus",
    "WorkloadStatus",
    "format_ms",
    "read_status",
    "status_table",
]

#: The window of the p95 wait (minutes), as the admin's Limiters page shows it.
P95_WINDOW_MINUTES = 15


@dataclass(frozen=True, slots=True)
class WorkloadStatus:
    """One workload now: ``limit`` is its ceiling, ``effective_limit`` the most it could
    hold now (reservations of the others are never lent); ``queued`` counts waiting and
    parked requests, ``parked`` the parked ones (Celery admission deferral)."""

    name: str
    held: int
    limit: int
    effective_limit: int
    reserved: int
    priority: int
    queued: int
    parked: int
    oldest_wait_ms: float | None


@dataclass(frozen=True, slots=True)
class LimiterStatus:
    """One stored limiter now, its workloads by name; a keyed limiter's counts are summed
    over its keys and its limits are each key's."""

    name: str
    keyed: bool
    limit: int
    max_queued: int | None
    workloads: tuple[WorkloadStatus, ...]
    #: The 95th percentile wait of the slots granted in the last
    #: :data:`P95_WINDOW_MINUTES` (``None``: none granted, or no events recorded).
    p95_wait_ms: float | None = None
    #: A keyed limiter's keys holding slots or with requests waiting.
    keys_in_use: int = 0

    @property
    def held(self) -> int:
        return sum(w.held for w in self.workloads)

    @property
    def queued(self) -> int:
        return sum(w.queued for w in self.workloads)

    @property
    def parked(self) -> int:
        return sum(w.parked for w in self.workloads)

    @property
    def oldest_wait_ms(self) -> float | None:
        waits = [w.oldest_wait_ms for w in self.workloads if w.oldest_wait_ms is not None]
        return max(waits) if waits else None

    def to_dict(self) -> dict[str, Any]:
        """The fields and totals, as ``--json`` prints them."""
        return {
            "name": self.name,
            "keyed": self.keyed,
            "held": self.held,
            "limit": self.limit,
            "max_queued": self.max_queued,
            "queued": self.queued,
            "parked": self.parked,
            "oldest_wait_ms": self.oldest_wait_ms,
            "p95_wait_ms": self.p95_wait_ms,
            "keys_in_use": self.keys_in_use,
            "workloads": [asdict(w) for w in self.workloads],
        }


def read_status(
    rows: Rows, *, events: bool, window_minutes: int = P95_WINDOW_MINUTES
) -> list[LimiterStatus]:
    """Every stored limiter's status, by name (keys of keyed limiters left out).

    :param events: the database has ``runcell_event`` (read the p95 waits from it).
    """
    gauges = gauges_from_rows(rows(WORKLOAD_GAUGES, None))
    stored = {
        str(name): (list(workloads), list(reserved), list(priorities), max_queued)
        for name, _config, workloads, reserved, priorities, max_queued in rows(
            statements.LIMITERS_NOT_KEYS, None
        )
    }
    names = sorted({g.limiter for g in gauges} & set(stored))
    p95: dict[str, float] = {}
    if events and names:
        params = {"names": names, "minutes": window_minutes}
        p95 = {
            str(name): float(ms)
            for name, ms in rows(statements.P95_WAITS, params)
            if ms is not None
        }
    found = []
    for name in names:
        workloads, reserved, priorities, max_queued = stored[name]
        mine = [g for g in gauges if g.limiter == name]
        found.append(
            LimiterStatus(
                name=name,
                keyed=mine[0].keyed,
                limit=mine[0].limit,
                max_queued=None if max_queued is None else int(max_queued),
                workloads=tuple(
                    WorkloadStatus(
                        name=g.workload,
                        held=g.held,
                        limit=g.workload_limit,
                        effective_limit=g.effective_limit,
                        reserved=_of(g.workload, workloads, reserved),
                        priority=_of(g.workload, workloads, priorities),
                        queued=g.queued,
                        parked=g.parked,
                        oldest_wait_ms=None if g.oldest_wait_s is None else g.oldest_wait_s * 1000,
                    )
                    for g in mine
                ),
                p95_wait_ms=p95.get(name),
                keys_in_use=max(g.keys_in_use for g in mine),
            )
        )
    return found


def _of(workload: str, workloads: Sequence[str], values: Sequence[Any]) -> int:
    """A workload's value in the limiter row's arrays (aligned with its workloads)."""
    if workload in workloads:
        i = workloads.index(workload)
        if i < len(values) and values[i] is not None:
            return int(values[i])
    return 0


#: The columns of :func:`status_table`, in order.
COLUMNS = ("limiter", "workload", "held", "limit", "queued", "parked", "oldest wait", "p95 wait")


def status_table(
    statuses: Sequence[LimiterStatus],
    *,
    columns: Sequence[str] = COLUMNS,
    window_minutes: int = P95_WINDOW_MINUTES,
) -> list[str]:
    """The lines of a table: per limiter a row of its totals, then one per workload
    (limits ``3 (1 reserved)``, a keyed limiter's ``2 per key``); ``columns`` chooses
    among :data:`COLUMNS`."""
    unknown = [c for c in columns if c not in COLUMNS]
    if unknown:
        raise ValueError(f"unknown columns {unknown!r}; the columns are {COLUMNS!r}")
    headers = {"p95 wait": f"p95 wait ({window_minutes} min)"}
    cells: list[dict[str, str]] = []
    for status in statuses:
        per_key = " per key" if status.keyed else ""
        cells.append(
            {
                "limiter": status.name,
                "workload": "(all)",
                "held": str(status.held),
                "limit": f"{status.limit}{per_key}",
                "queued": str(status.queued),
                "parked": str(status.parked),
                "oldest wait": format_ms(status.oldest_wait_ms),
                "p95 wait": format_ms(status.p95_wait_ms),
            }
        )
        for w in status.workloads:
            reserved = f" ({w.reserved} reserved)" if w.reserved else ""
            cells.append(
                {
                    "workload": w.name,
                    "held": str(w.held),
                    "limit": f"{w.limit}{per_key}{reserved}",
                    "queued": str(w.queued),
                    "parked": str(w.parked),
                }
            )
    table = [tuple(headers.get(c, c) for c in columns)]
    table += [tuple(row.get(c, "") for c in columns) for row in cells]
    widths = [max(len(row[i]) for row in table) for i in range(len(columns))]
    lines = []
    for i, row in enumerate(table):
        lines.append("  ".join(cell.ljust(widths[n]) for n, cell in enumerate(row)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * width for width in widths))
    return lines


def format_ms(ms: float | None) -> str:
    """``850 ms``, ``12.3 s``, ``4 min 05 s``, ``2 h 03 min``; ``-`` for nothing."""
    if ms is None:
        return "-"
    if ms < 0:
        return "-" + format_ms(-ms)
    if ms < 1_000:
        return f"{ms:.0f} ms"
    seconds = ms / 1000
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, seconds = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {seconds:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"
