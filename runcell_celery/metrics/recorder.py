"""Counters and histograms of this process, counted from its concurrency events.

:func:`install_event_metrics` adds one event listener (and, with Celery, a receiver
of :data:`runcell_celery.celery.signals.task_deferred`) that counts into
prometheus_client metrics. Each event is one dictionary lookup and one increment:
no I/O on the slot's path.

Which event counts where:

================= ======================================================
event             metric
================= ======================================================
acquired          ``runcell_slots_acquired_total``, ``runcell_wait_seconds``
released          ``runcell_slots_released_total{outcome}``,
                  ``runcell_hold_seconds``
timed-out         ``runcell_timeouts_total``
queue-full        ``runcell_queue_full_total``
wait-cancelled    ``runcell_waits_cancelled_total``
lease-lost        ``runcell_leases_lost_total{reason}``
limiter-error     ``runcell_limiter_errors_total{operation="acquire"}``
renewal-failed    ``runcell_limiter_errors_total{operation="renew"}``
release-failed    ``runcell_limiter_errors_total{operation="release"}``
task_deferred     ``runcell_deferrals_total`` (Celery signal: a deferral is no event)
================= ======================================================

``limiter`` is the label the admission counters use
(:func:`runcell_celery.celery.counters.counter_label`): a keyed limiter's name,
never its key's (``tenant``, not ``tenant:acme``), and a request over several
limiters under their names joined (``openai+tenant``), so these counts line up with
``admission_counts()`` label for label.

Under Celery's prefork pool each child counts its own events. Set
``PROMETHEUS_MULTIPROC_DIR`` in the worker's environment (before it starts):
prometheus_client then keeps every process's values in files there, a forked child
in files of its own, and the Django view or the exporter adds them up
(:func:`runcell_celery.metrics.exposition.build_registry`).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram

from ..background import DEFAULT_REGISTRY
from ..events import ConcurrencyEvent, add_event_listener, remove_event_listener
from ..keys import split_key_name
from .catalog import BUCKETS_SECONDS, spec

__all__ = ["EventMetrics", "install_event_metrics", "limiter_label", "uninstall_event_metrics"]

_LOST_REASONS = frozenset({"renewal", "max-hold", "expired-before-start"})
_ERROR_OPERATIONS = MappingProxyType(
    {
        "limiter-error": "acquire",
        "renewal-failed": "renew",
        "release-failed": "release",
    }
)


def _counter(name: str, registry: CollectorRegistry | None) -> Counter:
    metric = spec(name)
    return Counter(metric.family, metric.help, metric.labels, registry=registry)


def _histogram(name: str, registry: CollectorRegistry | None) -> Histogram:
    metric = spec(name)
    return Histogram(
        metric.family, metric.help, metric.labels, registry=registry, buckets=BUCKETS_SECONDS
    )


def limiter_label(names: tuple[str, ...]) -> str:
    """The ``limiter`` label of a request over ``names`` (keys by their keyed limiter's
    name, several joined with ``+``): the admission counters' label."""
    return "+".join(split_key_name(name)[0] for name in names) or "-"


class EventMetrics:
    """The event metrics of one process, and the listener that counts into them.

    :param registry: where the metrics are registered (``None``: nowhere, for a
        caller that collects them itself).
    """

    def __init__(self, registry: CollectorRegistry | None = REGISTRY) -> None:
        self.registry = registry
        self.acquired = _counter("runcell_slots_acquired_total", registry)
        self.released = _counter("runcell_slots_released_total", registry)
        self.wait = _histogram("runcell_wait_seconds", registry)
        self.hold = _histogram("runcell_hold_seconds", registry)
        self.deferrals = _counter("runcell_deferrals_total", registry)
        self.timeouts = _counter("runcell_timeouts_total", registry)
        self.queue_full = _counter("runcell_queue_full_total", registry)
        self.cancelled = _counter("runcell_waits_cancelled_total", registry)
        self.lost = _counter("runcell_leases_lost_total", registry)
        self.errors = _counter("runcell_limiter_errors_total", registry)

    def on_event(self, event: ConcurrencyEvent) -> None:
        """Event listener: count ``event`` (types no metric counts are ignored)."""
        limiter = limiter_label(event.limiters or (event.limiter,))
        workload = event.workload or ""
        kind = event.type
        if kind == "acquired":
            self.acquired.labels(limiter, workload).inc()
            self.wait.labels(limiter, workload).observe(_seconds(event.wait_ms))
        elif kind == "released":
            self.released.labels(limiter, workload, event.outcome or "unknown").inc()
            self.hold.labels(limiter, workload).observe(_seconds(event.hold_ms))
        elif kind == "timed-out":
            self.timeouts.labels(limiter, workload).inc()
        elif kind == "queue-full":
            self.queue_full.labels(limiter, workload).inc()
        elif kind == "wait-cancelled":
            self.cancelled.labels(limiter, workload).inc()
        elif kind == "lease-lost":
            reason = event.reason if event.reason in _LOST_REASONS else "other"
            self.lost.labels(limiter, workload, reason).inc()
        elif kind in _ERROR_OPERATIONS:
            self.errors.labels(limiter, workload, _ERROR_OPERATIONS[kind]).inc()

    def on_deferred(
        self, sender: object = None, *, limiter: str, workload: str | None = None, **_: Any
    ) -> None:
        """Receiver of ``task_deferred``: count one parked delivery."""
        self.deferrals.labels(limiter, workload or "").inc()

    def unregister(self) -> None:
        """Take the metrics out of their registry."""
        if self.registry is None:
            return
        for metric in (
            self.acquired,
            self.released,
            self.wait,
            self.hold,
            self.deferrals,
            self.timeouts,
            self.queue_full,
            self.cancelled,
            self.lost,
            self.errors,
        ):
            self.registry.unregister(metric)


def _seconds(ms: float | None) -> float:
    return max(0.0, (ms or 0.0) / 1000.0)


def install_event_metrics() -> EventMetrics:
    """Count this process's events into Prometheus metrics (once; later calls return
    the same :class:`EventMetrics`).

    Call it where the worker loads its Celery app (``celery.py``), before the pool
    forks: the children inherit the listener. The metrics go into prometheus_client's
    default registry, or into ``PROMETHEUS_MULTIPROC_DIR`` when that is set.
    """
    with DEFAULT_REGISTRY.lock("metrics.recorder"):
        installed: EventMetrics | None = DEFAULT_REGISTRY.value("metrics.installed", None)
        if installed is None:
            installed = EventMetrics()
            add_event_listener(installed.on_event)
            _connect_deferrals(installed)
            DEFAULT_REGISTRY.put("metrics.installed", installed)
        return installed


def uninstall_event_metrics() -> None:
    """Stop counting and unregister the metrics (tests; a process that reconfigures)."""
    with DEFAULT_REGISTRY.lock("metrics.recorder"):
        metrics: EventMetrics | None = DEFAULT_REGISTRY.value("metrics.installed", None)
        DEFAULT_REGISTRY.put("metrics.installed", None)
    if metrics is None:
        return
    remove_event_listener(metrics.on_event)
    try:
        from ..celery.signals import task_deferred
    except ImportError:  # pragma: no cover - without the celery extra
        pass
    else:
        task_deferred.disconnect(metrics.on_deferred)
    metrics.unregister()


def _connect_deferrals(metrics: EventMetrics) -> None:
    try:
        from ..celery.signals import task_deferred
    except ImportError:  # pragma: no cover - without the celery extra: nothing defers
        return
    task_deferred.connect(metrics.on_deferred, weak=False)
