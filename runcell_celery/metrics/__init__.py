"""Prometheus metrics (the ``metrics`` extra): event counters and histograms, live gauges.

Count events with :func:`install_event_metrics` where the workers load the Celery app
(before the pool forks); serve them with the Django view
:func:`runcell_django.metrics.metrics_view` or ``python -m runcell_celery.metrics``.
"""

from .catalog import BUCKETS_SECONDS, DATABASE_METRICS, EVENT_METRICS, METRICS, MetricSpec
from .exposition import bearer_token_matches, build_registry, multiprocess_dir, render
from .gauges import DEFAULT_CACHE_SECONDS, LimiterGaugeCollector
from .recorder import EventMetrics, install_event_metrics, uninstall_event_metrics

__all__ = [
    "BUCKETS_SECONDS",
    "DATABASE_METRICS",
    "DEFAULT_CACHE_SECONDS",
    "EVENT_METRICS",
    "METRICS",
    "EventMetrics",
    "LimiterGaugeCollector",
    "MetricSpec",
    "bearer_token_matches",
    "build_registry",
    "install_event_metrics",
    "multiprocess_dir",
    "render",
    "uninstall_event_metrics",
]
