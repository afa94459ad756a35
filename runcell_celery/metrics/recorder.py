"""Counters and histograms of this process, counted from its concurrency events.

Each event is one dictionary lookup and one increment: no I/O on the slot's path. A
deferral is no event, so with Celery the ``task_deferred`` signal counts
``runcell_deferrals_total``. The ``limiter`` label is the admission counters'
(:func:`runcell_celery.celery.counters.counter_label`): a keyed limiter's name, never its
key's, and several limiters joined (``openai+tenant``), so both line up label for label.

Under Celery's prefork pool each child counts its own events: set
``PROMETHEUS_MULTIPROC_DIR`` before the worker starts, and prometheus_client keeps every
process's values in files there for the view or the exporter to add up.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram
from prometheus_client.metrics import MetricWrapperBase

from ..events import ConcurrencyEvent, add_event_listener, remove_event_listener
from ..keys import split_key_name
from .catalog import BUCKETS_SECONDS, spec

if TYPE_CHECKING:
    from celery.utils.dispatch import Signal

__all__ = ["EventMetrics", "install_event_metrics", "limiter_label", "uninstall_event_metrics"]

_LOST_REASONS = frozenset({"renewal", "max-hold", "expired-before-start"})
_ERROR_OPERATIONS = {
    "limiter-error": "acquire",
    "renewal-failed": "renew",
    "release-failed": "release",
}


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

        def counter(name: str) -> Counter:
            m = spec(name)
            return Counter(m.family, m.help, m.labels, registry=registry)

        def histogram(name: str) -> Histogram:
            m = spec(name)
            return Histogram(m.name, m.help, m.labels, registry=registry, buckets=BUCKETS_SECONDS)

        self.acquired = counter("runcell_slots_acquired_total")
        self.released = counter("runcell_slots_released_total")
        self.wait = histogram("runcell_wait_seconds")
        self.hold = histogram("runcell_hold_seconds")
        self.deferrals = counter("runcell_deferrals_total")
        self.timeouts = counter("runcell_timeouts_total")
        self.queue_full = counter("runcell_queue_full_total")
        self.cancelled = counter("runcell_waits_cancelled_total")
        self.lost = counter("runcell_leases_lost_total")
        self.errors = counter("runcell_limiter_errors_total")

    def on_event(self, event: ConcurrencyEvent) -> None:
        """Event listener: count ``event`` (types no metric counts are ignored)."""
        labels = (limiter_label(event.limiters or (event.limiter,)), event.workload or "")
        kind = event.type
        if kind == "acquired":
            self.acquired.labels(*labels).inc()
            self.wait.labels(*labels).observe(_seconds(event.wait_ms))
        elif kind == "released":
            self.released.labels(*labels, event.outcome or "unknown").inc()
            self.hold.labels(*labels).observe(_seconds(event.hold_ms))
        elif kind == "timed-out":
            self.timeouts.labels(*labels).inc()
        elif kind == "queue-full":
            self.queue_full.labels(*labels).inc()
        elif kind == "wait-cancelled":
            self.cancelled.labels(*labels).inc()
        elif kind == "lease-lost":
            reason = event.reason if event.reason in _LOST_REASONS else "other"
            self.lost.labels(*labels, reason).inc()
        elif kind in _ERROR_OPERATIONS:
            self.errors.labels(*labels, _ERROR_OPERATIONS[kind]).inc()

    def on_deferred(
        self, sender: object = None, *, limiter: str, workload: str | None = None, **_: Any
    ) -> None:
        """Receiver of ``task_deferred``: count one parked delivery."""
        self.deferrals.labels(limiter, workload or "").inc()

    def unregister(self) -> None:
        """Take the metrics out of their registry."""
        for metric in vars(self).values():
            if self.registry is not None and isinstance(metric, MetricWrapperBase):
                self.registry.unregister(metric)


def _seconds(ms: float | None) -> float:
    return max(0.0, (ms or 0.0) / 1000.0)


def _task_deferred() -> Signal | None:
    try:
        from ..celery.signals import task_deferred
    except ImportError:  # pragma: no cover - without the celery extra: nothing defers
        return None
    return task_deferred


_installed: EventMetrics | None = None
_lock = threading.Lock()


def install_event_metrics() -> EventMetrics:
    """Count this process's events into Prometheus metrics (once; later calls return
    the same :class:`EventMetrics`).

    Call it where the worker loads its Celery app, before the pool forks, so the
    children inherit the listener.
    """
    global _installed
    with _lock:
        if _installed is None:
            metrics = EventMetrics()
            add_event_listener(metrics.on_event)
            if (signal := _task_deferred()) is not None:
                signal.connect(metrics.on_deferred, weak=False)
            _installed = metrics
        return _installed


def uninstall_event_metrics() -> None:
    """Stop counting and unregister the metrics (tests; a process that reconfigures)."""
    global _installed
    with _lock:
        metrics, _installed = _installed, None
    if metrics is not None:
        remove_event_listener(metrics.on_event)
        if (signal := _task_deferred()) is not None:
            signal.disconnect(metrics.on_deferred)
        metrics.unregister()
