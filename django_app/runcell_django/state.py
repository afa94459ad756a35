"""Each limiter's live state, as the admin and the dashboard show it (``runcell_status``
prints :func:`runcell_celery.postgres.operations.status_table`)."""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import dataclass

from django.utils.translation import gettext as _

from runcell_celery.postgres import LimiterState as BackendLimiterState
from runcell_celery.postgres.operations import format_ms as format_ms  # the pages' too

from .charts import Bar, bar
from .models import Limiter


@dataclass(frozen=True, slots=True)
class WorkloadState:
    """Slots one workload holds against its ceiling, and its requests waiting."""

    name: str
    active: int
    limit: int | None
    reserved: int
    queued: int


@dataclass(frozen=True, slots=True)
class LimiterState:
    """A limiter's stored limits and live counts (database time)."""

    name: str
    active: int
    limit: int | None
    max_queued: int | None
    queued: int
    oldest_wait_ms: float | None
    p95_wait_ms: float | None
    workloads: tuple[WorkloadState, ...]
    #: A keyed limiter's row: ``limit`` and ``max_queued`` are each key's, and the
    #: counts are summed over its keys (its own row holds nothing).
    keyed: bool = False
    #: A key's row: the keyed limiter whose limits it has.
    parent: str | None = None
    #: A keyed limiter's keys stored, and those holding slots or with requests waiting.
    keys: int = 0
    keys_in_use: int = 0

    @classmethod
    def of(cls, limiter: Limiter) -> LimiterState:
        """Build from a row of ``Limiter.objects.with_live_stats()`` (its stored limits and
        the live counts the backend gave it)."""
        limits = limiter.limits
        configured = limits.workloads if limits is not None else {}
        live: BackendLimiterState | None = getattr(limiter, "live_state", None)
        active: Mapping[str, int] = live.active if live is not None else {}
        queued: Mapping[str, int] = live.queued if live is not None else {}
        usage: Mapping[str, object] | None = getattr(limiter, "key_usage", None)
        keyed = limiter.parent is None and bool(
            limits.keyed if limits is not None else limiter.config.get("keyed")
        )
        if keyed and usage is not None:
            active, queued = _key_totals(usage)
        names = [*sorted(configured), *sorted({*active, *queued} - set(configured))]
        workloads = tuple(
            WorkloadState(
                name=name,
                active=int(active.get(name, 0)),
                limit=configured[name].max_concurrent if name in configured else None,
                reserved=configured[name].reserved if name in configured else 0,
                queued=int(queued.get(name, 0)),
            )
            for name in names
        )
        return cls(
            name=limiter.name,
            active=sum(w.active for w in workloads),
            limit=limits.max_concurrent if limits is not None else None,
            max_queued=limits.max_queued if limits is not None else None,
            queued=sum(w.queued for w in workloads),
            oldest_wait_ms=live.oldest_wait_ms if live is not None else None,
            p95_wait_ms=getattr(limiter, "p95_wait_ms", None),
            workloads=workloads,
            keyed=keyed,
            parent=limiter.parent,
            keys=_count(usage, "keys"),
            keys_in_use=_count(usage, "in_use"),
        )

    def bars(self, width: int = 120) -> tuple[Bar, ...]:
        """Slots held against the limit: all workloads, then each against its ceiling; a
        keyed limiter's (its keys' summed, which no limit bounds) as numbers without bars."""
        if self.keyed:
            per_key = _("%s per key") % self.limit if self.limit is not None else ""
            return (
                bar(_("all keys"), self.active, None, note=per_key, width=0),
                *(bar(w.name, w.active, None, width=0) for w in self.workloads),
            )
        return (
            bar(_("all workloads"), self.active, self.limit, width=width),
            *(
                bar(
                    w.name,
                    w.active,
                    w.limit,
                    note=_("%d reserved") % w.reserved if w.reserved else "",
                    width=width,
                )
                for w in self.workloads
            ),
        )


def _count(usage: Mapping[str, object] | None, name: str) -> int:
    value = usage.get(name) if usage is not None else None
    return int(value) if isinstance(value, int | float) else 0


def _key_totals(usage: Mapping[str, object]) -> tuple[dict[str, int], dict[str, int]]:
    """Slots held and requests waiting per workload over a keyed limiter's keys, from
    ``key_usage["workloads"]`` (``{workload: [held, waiting]}``)."""
    per_workload = usage.get("workloads")
    active: dict[str, int] = {}
    queued: dict[str, int] = {}
    if isinstance(per_workload, Mapping):
        for name, counts in per_workload.items():
            held, waiting = counts if isinstance(counts, list) and len(counts) == 2 else (0, 0)
            if held:
                active[str(name)] = int(held)
            if waiting:
                queued[str(name)] = int(waiting)
    return active, queued


def live_states() -> list[LimiterState]:
    """The live state of every stored limiter, keys left out (a keyed limiter sums them)."""
    limiters = Limiter.objects.without_keys().with_key_usage().with_live_stats()
    return [LimiterState.of(row) for row in limiters]


def format_duration(value: datetime.timedelta | None) -> str:
    """A database interval, as :func:`format_ms` writes it."""
    return "-" if value is None else format_ms(value.total_seconds() * 1000)
