"""Gauges of the limiters' live state, read from the database at scrape time.

:class:`LimiterGaugeCollector` asks its reader (by default
:func:`runcell_celery.postgres.read_workload_gauges`: one query for every limiter and
workload) at most once per ``cache_seconds``, however many scrapes or scrapers come:
two Prometheus servers, or a dashboard refreshing, cost one read a second. The
figures are the fleet's, not this process's, so they are right whichever process
serves them, and under any worker pool.

A read that fails (the database down, or slower than the read's own timeout) does
not fail the scrape: ``runcell_database_up`` says 0, the state gauges are left out
(stale figures would look live), the event metrics are served as usual, and the
failure is kept for the cache's lifetime so a dead database is not hammered. A
scrape that comes while another read is under way is served what was read last,
never queued behind it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .catalog import spec

if TYPE_CHECKING:  # the reader may be any callable; PostgreSQL's is the usual one
    from ..postgres.gauges import WorkloadGauges

__all__ = ["DEFAULT_CACHE_SECONDS", "GaugeReader", "LimiterGaugeCollector"]

logger = logging.getLogger("runcell_celery.metrics")

#: How long one read of the limiter tables serves scrapes.
DEFAULT_CACHE_SECONDS = 1.0

GaugeReader = Callable[[], "Sequence[WorkloadGauges]"]


@dataclass(frozen=True, slots=True)
class _Snapshot:
    read_at: float
    gauges: tuple[WorkloadGauges, ...]
    up: bool


class LimiterGaugeCollector(Collector):
    """A prometheus_client collector of the limiters' live state.

    :param read: returns every limiter's figures per workload; raises when the
        database fails.
    :param cache_seconds: how long a read serves scrapes (``0``: every scrape reads).
    :param clock: monotonic seconds (tests pass a fake clock).
    :raises ValueError: ``cache_seconds`` is negative.
    """

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
        snapshot = self._current()
        yield from _families(snapshot.gauges if snapshot is not None and snapshot.up else ())
        up = GaugeMetricFamily("runcell_database_up", spec("runcell_database_up").help, labels=())
        if snapshot is not None:
            up.add_metric((), 1.0 if snapshot.up else 0.0)
        yield up

    def _fresh(self, snapshot: _Snapshot | None) -> bool:
        return snapshot is not None and self._clock() - snapshot.read_at < self._cache_seconds

    def _current(self) -> _Snapshot | None:
        snapshot = self._snapshot
        if self._fresh(snapshot):
            return snapshot
        if not self._reading.acquire(blocking=False):
            return snapshot  # another scrape is reading: serve the last figures
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


def _family(name: str) -> GaugeMetricFamily:
    metric = spec(name)
    return GaugeMetricFamily(metric.name, metric.help, labels=metric.labels)


def _families(gauges: Sequence[WorkloadGauges]) -> Iterator[GaugeMetricFamily]:
    held = _family("runcell_slots_held")
    limit = _family("runcell_limit")
    workload_limit = _family("runcell_workload_limit")
    effective = _family("runcell_effective_limit")
    queued = _family("runcell_requests_queued")
    parked = _family("runcell_requests_parked")
    oldest = _family("runcell_oldest_wait_seconds")
    keys = _family("runcell_keys_in_use")
    seen: set[str] = set()
    for g in gauges:
        labels = (g.limiter, g.workload)
        held.add_metric(labels, g.held)
        workload_limit.add_metric(labels, g.workload_limit)
        effective.add_metric(labels, g.effective_limit)
        queued.add_metric(labels, g.queued)
        parked.add_metric(labels, g.parked)
        oldest.add_metric(labels, g.oldest_wait_s or 0.0)
        if g.limiter not in seen:
            seen.add(g.limiter)
            limit.add_metric((g.limiter,), g.limit)
            if g.keyed:
                keys.add_metric((g.limiter,), g.keys_in_use)
    yield from (held, limit, workload_limit, effective, queued, parked, oldest, keys)
