"""This process's counters and histograms, counted from its concurrency events.

Each event costs a lookup and an increment, no I/O on the slot's path; a deferral is no
event, so Celery's ``task_deferred`` signal counts it. The ``limiter`` label is the
admission counters' (a keyed limiter's name, never a key; several joined with ``+``), so
both line up. Under prefork each child counts its own: set ``PROMETHEUS_MULTIPROC_DIR``
before the worker starts, and the view or the exporter adds the children's files up.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram

from ..background import DEFAULT_REGISTRY
from ..events import ConcurrencyEvent, add_event_listener, remove_event_listener
from ..keys import split_key_name
from .catalog import BUCKETS_SECONDS, EVENT_METRICS

if TYPE_CHECKING:
    from celery.utils.dispatch import Signal

__all__ = ["EventMetrics", "install_event_metrics", "limiter_label", "uninstall_event_metrics"]

#: The counter each event type adds one to (a deferral is no event: see on_deferred).
_COUNTER_OF = MappingProxyType(
    {
        "acquired": "runcell_slots_acquired_total",
        "released": "runcell_slots_released_total",
        "timed-out": "runcell_timeouts_total",
        "queue-full": "runcell_queue_full_total",
        "wait-cancelled": "runcell_waits_cancelled_total",
        "lease-lost": "runcell_leases_lost_total",
        "limiter-error": "runcell_limiter_errors_total",
        "renewal-failed": "runcell_limiter_errors_total",
        "release-failed": "runcell_limiter_errors_total",
    }
)
_LOST_REASONS = frozenset({"renewal", "max-hold", "expired-before-start"})
_OPERATIONS = MappingProxyType(
    {"limiter-error": "acquire", "renewal-failed": "renew", "release-failed": "release"}
)


def limiter_label(names: tuple[str, ...]) -> str:
    """The ``limiter`` label of a request over ``names``: the admission counters' label."""
    return "+".join(split_key_name(name)[0] for name in names) or "-"


class EventMetrics:
    """The event metrics of one process, and the listener that counts into them.

    :param registry: where the metrics are registered (``None``: nowhere, for a
        caller that collects them itself).
    """

    def __init__(self, registry: CollectorRegistry | None = REGISTRY) -> None:
        self.registry = registry
        self.counters = {
            m.name: Counter(m.family, m.help, m.labels, registry=registry)
            for m in EVENT_METRICS
            if m.kind == "counter"
        }
        self.histograms = {
            m.name: Histogram(m.name, m.help, m.labels, registry=registry, buckets=BUCKETS_SECONDS)
            for m in EVENT_METRICS
            if m.kind == "histogram"
        }

    def on_event(self, event: ConcurrencyEvent) -> None:
        """Event listener: count ``event`` (types no metric counts are ignored)."""
        kind = event.type
        if kind not in _COUNTER_OF:
            return
        labels = [limiter_label(event.limiters or (event.limiter,)), event.workload or ""]
        if kind == "acquired":
            self.histograms["runcell_wait_seconds"].labels(*labels).observe(_seconds(event.wait_ms))
        elif kind == "released":
            self.histograms["runcell_hold_seconds"].labels(*labels).observe(_seconds(event.hold_ms))
            labels.append(event.outcome or "unknown")
        elif kind == "lease-lost":
            labels.append(event.reason if event.reason in _LOST_REASONS else "other")
        elif kind in _OPERATIONS:
            labels.append(_OPERATIONS[kind])
        self.counters[_COUNTER_OF[kind]].labels(*labels).inc()

    def on_deferred(
        self, sender: object = None, *, limiter: str, workload: str | None = None, **_: Any
    ) -> None:
        """Receiver of ``task_deferred``: count one parked delivery."""
        self.counters["runcell_deferrals_total"].labels(limiter, workload or "").inc()

    def unregister(self) -> None:
        """Take the metrics out of their registry."""
        for metric in (*self.counters.values(), *self.histograms.values()):
            if self.registry is not None:
                self.registry.unregister(metric)


def _seconds(ms: float | None) -> float:
    return max(0.0, (ms or 0.0) / 1000.0)


def _task_deferred() -> Signal | None:
    try:
        from ..celery.signals import task_deferred
    except ImportError:  # pragma: no cover - without the celery extra: nothing defers
        return None
    return task_deferred


def install_event_metrics() -> EventMetrics:
    """Count this process's events into Prometheus metrics, once (later calls return the
    same :class:`EventMetrics`); call it before the pool forks, so children inherit it."""
    with DEFAULT_REGISTRY.lock("metrics.recorder"):
        installed: EventMetrics | None = DEFAULT_REGISTRY.value("metrics.installed", None)
        if installed is None:
            installed = EventMetrics()
            add_event_listener(installed.on_event)
            if (signal := _task_deferred()) is not None:
                signal.connect(installed.on_deferred, weak=False)
            DEFAULT_REGISTRY.put("metrics.installed", installed)
        return installed


def uninstall_event_metrics() -> None:
    """Stop counting and unregister the metrics (tests; a process that reconfigures)."""
    with DEFAULT_REGISTRY.lock("metrics.recorder"):
        metrics: EventMetrics | None = DEFAULT_REGISTRY.value("metrics.installed", None)
        DEFAULT_REGISTRY.put("metrics.installed", None)
    if metrics is not None:
        remove_event_listener(metrics.on_event)
        if (signal := _task_deferred()) is not None:
            signal.disconnect(metrics.on_deferred)
        metrics.unregister()
