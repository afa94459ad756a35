"""Prometheus metrics: event counters and histograms, live gauges, an exporter.

.. code-block:: python

    # celery.py, where the workers load the app (before the pool forks)
    from runcell_celery.metrics import install_event_metrics
    install_event_metrics()

Then serve them: the Django view :func:`runcell_django.metrics.metrics_view`, or
the standalone exporter ``python -m runcell_celery.metrics --port 9464``.

Needs the ``metrics`` extra (prometheus-client).
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
