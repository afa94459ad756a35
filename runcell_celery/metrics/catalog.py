"""Every metric runcell exports: its name, type, labels and meaning, in one place.

The collectors build their metrics from these tables; a test holds the docs' table
and the Grafana dashboard to them. Labels are bounded on purpose: ``limiter`` and
``workload`` (from the configured limits) and small fixed sets (``outcome``, ``reason``,
``operation``), never a task id, a run id or a key (a keyed limiter's tenants are
counted under its name).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["BUCKETS_SECONDS", "DATABASE_METRICS", "EVENT_METRICS", "METRICS", "MetricSpec"]

# fmt: off
#: Histogram buckets for waits and holds, from a free slot to a ten-minute generation.
#: From 0.1 s on each bound is at most 1.5x the one below (1.25x where parked waits
#: fall), so a p95 from ``histogram_quantile`` stays close to the admin's exact one.
BUCKETS_SECONDS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.25, 0.35, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 2.5,
    3.0, 3.5, 4.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0, 180.0, 300.0,
    600.0,
)
# fmt: on

Kind = Literal["counter", "histogram", "gauge"]
Source = Literal["events", "database"]


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """One metric as scraped (a histogram's samples add ``_bucket``, ``_count``, ``_sum``).

    ``source`` is ``events`` (each process counts its own, :mod:`.recorder`) or
    ``database`` (read from the limiter tables at scrape time, for the whole fleet).
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
_Row = tuple[str, Kind, tuple[str, ...], str]


def _table(source: Source, *rows: _Row) -> tuple[MetricSpec, ...]:
    return tuple(MetricSpec(*row, source=source) for row in rows)


# The tables are kept one metric to a row or two, as docs/metrics.md shows them.
# fmt: off
#: The metrics each process counts from its own slot events.
EVENT_METRICS = _table(
    "events",
    ("runcell_slots_acquired_total", "counter", _LW, "Slots acquired."),
    ("runcell_slots_released_total", "counter", (*_LW, "outcome"),
     "Slots released, by how the hold ended (success, error, cancelled, timed-out, max-hold)."),
    ("runcell_wait_seconds", "histogram", _LW, "How long each acquired slot was waited for."),
    ("runcell_hold_seconds", "histogram", _LW, "How long each released slot was held."),
    ("runcell_deferrals_total", "counter", _LW,
     "Celery deliveries parked because no slot was free (admission deferral; not failures)."),
    ("runcell_timeouts_total", "counter", _LW,
     "Requests that gave up waiting for a slot (timed-out), parked ones included."),
    ("runcell_queue_full_total", "counter", _LW,
     "Requests refused because the limiter's queue was full."),
    ("runcell_waits_cancelled_total", "counter", _LW,
     "Waits ended by cancellation (a revoked task, a cancelled run)."),
    ("runcell_leases_lost_total", "counter", (*_LW, "reason"),
     "Held slots lost before release, by reason (renewal, max-hold, expired-before-start)."),
    ("runcell_limiter_errors_total", "counter", (*_LW, "operation"),
     "Limiter calls that failed (the database down or too slow), "
     "by operation (acquire, renew, release)."),
)

#: The metrics read from the limiter's tables at scrape time (the fleet's state now).
DATABASE_METRICS = _table(
    "database",
    ("runcell_slots_held", "gauge", _LW, "Slots held now."),
    ("runcell_limit", "gauge", ("limiter",),
     "The limiter's max_concurrent (each key's, for a keyed limiter)."),
    ("runcell_workload_limit", "gauge", _LW,
     "The workload's ceiling: its max_concurrent, at most the limiter's."),
    ("runcell_effective_limit", "gauge", _LW,
     "The most slots the workload could hold now: its ceiling, less what other "
     "workloads hold or keep reserved (summed over a keyed limiter's keys)."),
    ("runcell_requests_queued", "gauge", _LW,
     "Requests in line for a slot now, waiting or parked."),
    ("runcell_requests_parked", "gauge", _LW,
     "Of the requests in line, those parked (Celery admission deferral)."),
    ("runcell_oldest_wait_seconds", "gauge", _LW,
     "How long the oldest request in line has waited (0: none waits)."),
    ("runcell_keys_in_use", "gauge", ("limiter",),
     "Keys of a keyed limiter holding a slot or with a request in line."),
    ("runcell_database_up", "gauge", (),
     "1 if the last read of the limiter tables succeeded, 0 if it failed."),
)
# fmt: on

#: Every metric, in the order the documentation lists them.
METRICS: tuple[MetricSpec, ...] = EVENT_METRICS + DATABASE_METRICS
