"""Every metric runcell exports: its name, type, labels and meaning, in one place.

The collectors build their metrics from this list, the README's table lists the
same, and the Grafana dashboard queries these names; a test holds the three
together. Names follow Prometheus's conventions: the ``runcell_`` prefix, base units
(``_seconds``), ``_total`` on counters.

Labels are bounded on purpose: ``limiter`` and ``workload`` (both from the limits
you configured), plus small fixed sets where a count is split by what happened
(``outcome``, ``reason``, ``operation``). Never a task id, a run id or a key: a
keyed limiter's 100,000 tenants are counted under the keyed limiter's name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = [
    "BUCKETS_SECONDS",
    "DATABASE_METRICS",
    "EVENT_METRICS",
    "METRICS",
    "MetricSpec",
    "spec",
]

#: Histogram buckets for waits and holds, in seconds: from a few milliseconds (a
#: free slot) to ten minutes (a long generation, or a batch behind a busy limit).
#: From 0.1 s on, each bound is at most 1.5x the one below (1.25x from 1 s to 5 s,
#: where parked waits fall): ``histogram_quantile`` interpolates inside a bucket, so
#: a p95 read from Prometheus is only as close to the admin's exact one as its bucket
#: is narrow.
BUCKETS_SECONDS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.15,
    0.25,
    0.35,
    0.5,
    0.75,
    1.0,
    1.25,
    1.5,
    2.0,
    2.5,
    3.0,
    3.5,
    4.0,
    5.0,
    7.5,
    10.0,
    15.0,
    20.0,
    30.0,
    45.0,
    60.0,
    90.0,
    120.0,
    180.0,
    300.0,
    600.0,
)

Kind = Literal["counter", "histogram", "gauge"]
Source = Literal["events", "database"]


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """One metric as exposed.

    :param name: the name as scraped (a counter's with ``_total``; a histogram's
        samples add ``_bucket``, ``_count`` and ``_sum``).
    :param kind: ``counter``, ``histogram`` or ``gauge``.
    :param labels: its label names, in order.
    :param help: what it measures (the ``# HELP`` line).
    :param source: ``events`` — counted by each process from its own events (see
        :mod:`runcell_celery.metrics.recorder`); ``database`` — read from the limiter
        tables at scrape time, for the whole fleet.
    """

    name: str
    kind: Kind
    labels: tuple[str, ...]
    help: str
    source: Source

    @property
    def family(self) -> str:
        """The family name prometheus_client and the text parser use (no ``_total``)."""
        return self.name.removesuffix("_total") if self.kind == "counter" else self.name


_LW = ("limiter", "workload")

EVENT_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("runcell_slots_acquired_total", "counter", _LW, "Slots acquired.", "events"),
    MetricSpec(
        "runcell_slots_released_total",
        "counter",
        (*_LW, "outcome"),
        "Slots released, by how the hold ended (success, error, cancelled, timed-out, max-hold).",
        "events",
    ),
    MetricSpec(
        "runcell_wait_seconds",
        "histogram",
        _LW,
        "How long each acquired slot was waited for.",
        "events",
    ),
    MetricSpec(
        "runcell_hold_seconds",
        "histogram",
        _LW,
        "How long each released slot was held.",
        "events",
    ),
    MetricSpec(
        "runcell_deferrals_total",
        "counter",
        _LW,
        "Celery deliveries parked because no slot was free (admission deferral; not failures).",
        "events",
    ),
    MetricSpec(
        "runcell_timeouts_total",
        "counter",
        _LW,
        "Requests that gave up waiting for a slot (timed-out), parked ones included.",
        "events",
    ),
    MetricSpec(
        "runcell_queue_full_total",
        "counter",
        _LW,
        "Requests refused because the limiter's queue was full.",
        "events",
    ),
    MetricSpec(
        "runcell_waits_cancelled_total",
        "counter",
        _LW,
        "Waits ended by cancellation (a revoked task, a cancelled run).",
        "events",
    ),
    MetricSpec(
        "runcell_leases_lost_total",
        "counter",
        (*_LW, "reason"),
        "Held slots lost before release, by reason (renewal, max-hold, expired-before-start).",
        "events",
    ),
    MetricSpec(
        "runcell_limiter_errors_total",
        "counter",
        (*_LW, "operation"),
        "Limiter calls that failed (the database down or too slow), "
        "by operation (acquire, renew, release).",
        "events",
    ),
)

DATABASE_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec("runcell_slots_held", "gauge", _LW, "Slots held now.", "database"),
    MetricSpec(
        "runcell_limit",
        "gauge",
        ("limiter",),
        "The limiter's max_concurrent (each key's, for a keyed limiter).",
        "database",
    ),
    MetricSpec(
        "runcell_workload_limit",
        "gauge",
        _LW,
        "The workload's ceiling: its max_concurrent, at most the limiter's.",
        "database",
    ),
    MetricSpec(
        "runcell_effective_limit",
        "gauge",
        _LW,
        "The most slots the workload could hold now: its ceiling, less what other "
        "workloads hold or keep reserved (summed over a keyed limiter's keys).",
        "database",
    ),
    MetricSpec(
        "runcell_requests_queued",
        "gauge",
        _LW,
        "Requests in line for a slot now, waiting or parked.",
        "database",
    ),
    MetricSpec(
        "runcell_requests_parked",
        "gauge",
        _LW,
        "Of the requests in line, those parked (Celery admission deferral).",
        "database",
    ),
    MetricSpec(
        "runcell_oldest_wait_seconds",
        "gauge",
        _LW,
        "How long the oldest request in line has waited (0: none waits).",
        "database",
    ),
    MetricSpec(
        "runcell_keys_in_use",
        "gauge",
        ("limiter",),
        "Keys of a keyed limiter holding a slot or with a request in line.",
        "database",
    ),
    MetricSpec(
        "runcell_database_up",
        "gauge",
        (),
        "1 if the last read of the limiter tables succeeded, 0 if it failed.",
        "database",
    ),
)

METRICS: tuple[MetricSpec, ...] = EVENT_METRICS + DATABASE_METRICS


def spec(name: str) -> MetricSpec:
    """The metric named ``name`` (as scraped, or its family name).

    :raises KeyError: no metric has that name; the message lists them.
    """
    for metric in METRICS:
        if name in (metric.name, metric.family):
            return metric
    raise KeyError(f"no runcell metric is named {name!r}; known: {[m.name for m in METRICS]}")
