"""What a scrape serves: the event metrics and the limiters' gauges, as text.

:func:`build_registry` puts together, for the Django view and the exporter alike:

* the event metrics — with ``multiprocess_dir`` (``PROMETHEUS_MULTIPROC_DIR``), the
  values every process on this host wrote there (prometheus_client's
  ``MultiProcessCollector``: a prefork worker's children each write their own files,
  and the sums include children that have since exited); without it, this
  process's own registry (right for a solo or threads worker serving itself, blind to
  other processes);
* the gauges of the limiters' live state, read from the database
  (:class:`~runcell_celery.metrics.gauges.LimiterGaugeCollector`).

:func:`render` writes a registry in the format the scraper asked for (Prometheus
text, or OpenMetrics), and :func:`bearer_token_matches` checks a scrape's
``Authorization`` header in constant time.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Iterable
from pathlib import Path

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

__all__ = ["MULTIPROC_ENV", "bearer_token_matches", "build_registry", "multiprocess_dir", "render"]

#: prometheus_client's own variable: where every process writes its values.
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def multiprocess_dir(given: str | os.PathLike[str] | None = None) -> Path | None:
    """The multiprocess directory to read: ``given``, else ``PROMETHEUS_MULTIPROC_DIR``.

    :raises ValueError: the directory does not exist (naming it, and where it came
        from): prometheus_client would otherwise serve nothing, silently.
    """
    source = "the multiprocess directory"
    if given is None:
        given = os.environ.get(MULTIPROC_ENV) or None
        source = MULTIPROC_ENV
    if given is None:
        return None
    path = Path(given)
    if not path.is_dir():
        raise ValueError(
            f"{source} = {str(given)!r} is invalid: no such directory (create it before the "
            "workers start, and give every worker and the exporter the same one)"
        )
    return path


def build_registry(
    *,
    gauges: Collector | None = None,
    multiproc: Path | None = None,
    process_registry: CollectorRegistry = REGISTRY,
) -> CollectorRegistry:
    """A registry for scrapes: event metrics (from ``multiproc``, else from
    ``process_registry``) and ``gauges`` when given."""
    registry = CollectorRegistry(auto_describe=False)
    if multiproc is not None:
        MultiProcessCollector(registry, path=str(multiproc))  # type: ignore[no-untyped-call]
    else:
        registry.register(_Forward(process_registry))
    if gauges is not None:
        registry.register(gauges)
    return registry


class _Forward(Collector):
    """Another registry's metrics, collected at scrape time."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterable[Metric]:
        return self._registry.collect()


def render(registry: CollectorRegistry, accept: str | None) -> tuple[bytes, str]:
    """The registry's metrics in the format ``accept`` asks for, and its content type."""
    encoder, content_type = choose_encoder(accept or "")
    return encoder(registry), content_type


def bearer_token_matches(authorization: str | None, token: str) -> bool:
    """Whether ``Authorization: Bearer <token>`` carries ``token`` (constant time)."""
    if not authorization:
        return False
    scheme, _, given = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(given.strip().encode(), token.encode())
