"""Gauges of the limiters' live state, read from the database at scrape time.

One read (by default :func:`runcell_celery.postgres.read_workload_gauges`, one query for
every limiter) serves every scrape and scraper for ``cache_seconds``. The figures are the
fleet's, so they are right whichever process serves them. A failed read does not fail
the scrape: ``runcell_database_up`` says 0 and the state gauges are left out (stale
figures would look live); the failure is cached too, so a dead database is not hammered.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, NamedTuple

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .catalog import DATABASE_METRICS

if TYPE_CHECKING:  # the reader may be any callable; PostgreSQL's is the usual one
    from ..postgres.gauges import WorkloadGauges

__all__ = ["DEFAULT_CACHE_SECONDS", "GaugeReader", "LimiterGaugeCollector"]

logger = logging.getLogger("runcell_celery.metrics")

#: How long one read of the limiter tables serves scrapes.
DEFAULT_CACHE_SECONDS = 1.0

GaugeReader = Callable[[], "Sequence[WorkloadGauges]"]

#: The per-workload gauges, and the field of ``WorkloadGauges`` each shows.
_PER_WORKLOAD = MappingProxyType(
    {
        "runcell_slots_held": "held",
        "runcell_workload_limit": "workload_limit",
        "runcell_effective_limit": "effective_limit",
        "runcell_requests_queued": "queued",
        "runcell_requests_parked": "parked",
        "runcell_oldest_wait_seconds": "oldest_wait_s",
    }
)


class _Snapshot(NamedTuple):
    read_at: float
    gauges: tuple[WorkloadGauges, ...]
    up: bool


class LimiterGaugeCollector(Collector):
    """A prometheus_client collector of the limiters' live state, from ``read`` (every
    limiter's figures per workload; raises when the database fails), one read serving
    scrapes for ``cache_seconds`` (``0``: every scrape reads) of ``clock``."""

    def __init__(
        self,
        read: GaugeReader,
        *,
        cache_seconds: float = DEFAULT_CACHE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if cache_seconds < 0:
            raise ValueError(f"cache_seconds = {cache_seconds!r} is invalid: must be 0 or more")
        self._read = read
        self._cache_seconds = cache_seconds
        self._clock = clock
        self._snapshot: _Snapshot | None = None
        self._reading = threading.Lock()

    def collect(self) -> Iterator[Metric]:
        families = {
            m.name: GaugeMetricFamily(m.name, m.help, labels=m.labels) for m in DATABASE_METRICS
        }
        snapshot = self._current()
        if snapshot is not None:
            families["runcell_database_up"].add_metric((), 1.0 if snapshot.up else 0.0)
        seen: set[str] = set()
        for g in snapshot.gauges if snapshot is not None else ():
            for name, field in _PER_WORKLOAD.items():
                families[name].add_metric((g.limiter, g.workload), getattr(g, field) or 0.0)
            if g.limiter not in seen:
                seen.add(g.limiter)
                families["runcell_limit"].add_metric((g.limiter,), g.limit)
                if g.keyed:
                    families["runcell_keys_in_use"].add_metric((g.limiter,), g.keys_in_use)
        yield from families.values()

    def _fresh(self, snapshot: _Snapshot | None) -> bool:
        return snapshot is not None and self._clock() - snapshot.read_at < self._cache_seconds

    def _current(self) -> _Snapshot | None:
        snapshot = self._snapshot
        if self._fresh(snapshot):
            return snapshot
        if not self._reading.acquire(blocking=False):
            return snapshot  # another scrape is reading: serve the last figures, never queue
        try:
            snapshot = self._snapshot
            if self._fresh(snapshot):
                return snapshot  # read by the scrape that held the lock
            try:
                gauges, up = tuple(self._read()), True
            except Exception as exc:
                logger.warning("runcell metrics: reading the limiters' state failed: %s", exc)
                gauges, up = (), False
            snapshot = self._snapshot = _Snapshot(self._clock(), gauges, up)
            return snapshot
        finally:
            self._reading.release()
