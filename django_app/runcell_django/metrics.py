"""The Prometheus metrics view: ``path("metrics", metrics_view)`` in your ``urls.py``.

It serves the workers' event metrics (``PROMETHEUS_MULTIPROC_DIR`` or
``RUNCELL["METRICS"]["MULTIPROCESS_DIR"]``) and the limiters' live gauges (one query per
scrape, cached ``CACHE_MS``) to a scrape bearing ``Authorization: Bearer <TOKEN>`` and to
staff users (``ALLOW_STAFF``). A wrong token gets 401; no token and no staff session 401
when a token is configured, else 403.
"""

from __future__ import annotations

from typing import Any

from django.http import HttpRequest, HttpResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET
from prometheus_client import CollectorRegistry

from runcell_celery import ConcurrencyConfigError
from runcell_celery.background import DEFAULT_REGISTRY
from runcell_celery.metrics import (
    LimiterGaugeCollector,
    bearer_token_matches,
    build_registry,
    multiprocess_dir,
    render,
)
from runcell_celery.postgres import PostgresBackend, read_workload_gauges

from . import conf

__all__ = ["metrics_view"]

#: The registry scrapes are served from, and what it was built for: rebuilt when the
#: settings change (``override_settings``, a reconfigured registry).
Built = tuple[tuple[Any, ...], CollectorRegistry] | None


@never_cache
@require_GET
def metrics_view(request: HttpRequest) -> HttpResponse:
    """Serve the metrics to a bearer of the token or a staff user; 401/403 otherwise."""
    settings = conf.metrics_settings()
    authorization = request.headers.get("Authorization")
    if authorization is not None and settings.token is not None:
        if not bearer_token_matches(authorization, settings.token):
            return _unauthorized("the bearer token is wrong")
    elif not (settings.allow_staff and _is_staff(request)):
        if settings.token is not None:
            return _unauthorized("a bearer token (RUNCELL['METRICS']['TOKEN']) is required")
        return HttpResponse(
            "runcell metrics: only staff users may read them here (set "
            "RUNCELL['METRICS']['TOKEN'] to let Prometheus scrape with a bearer token)\n",
            status=403,
            content_type="text/plain",
        )
    body, content_type = render(_registry(settings), request.headers.get("Accept"))
    return HttpResponse(body, content_type=content_type)


def _is_staff(request: HttpRequest) -> bool:
    user = getattr(request, "user", None)
    return bool(user is not None and user.is_authenticated and user.is_staff)


def _unauthorized(why: str) -> HttpResponse:
    response = HttpResponse(f"runcell metrics: {why}\n", status=401, content_type="text/plain")
    response["WWW-Authenticate"] = 'Bearer realm="runcell"'
    return response


def _registry(settings: conf.MetricsSettings) -> CollectorRegistry:
    """The registry for these settings and this process's backend (built once); live
    gauges only with the PostgreSQL backend (no other has fleet-wide state to read)."""
    found = conf.registry().backend
    backend = found if isinstance(found, PostgresBackend) else None
    key = (backend, settings.cache_ms, settings.multiprocess_dir)
    with DEFAULT_REGISTRY.lock("django.metrics"):
        _built: Built = DEFAULT_REGISTRY.value("django.metrics.built", None)
        if _built is None or _built[0] != key:
            try:
                where = multiprocess_dir(settings.multiprocess_dir)
            except ValueError as exc:
                raise ConcurrencyConfigError(f"RUNCELL['METRICS']: {exc}") from exc
            gauges = None
            if backend is not None:
                gauges = LimiterGaugeCollector(
                    lambda: read_workload_gauges(backend.pool),
                    cache_seconds=settings.cache_ms / 1000,
                )
            _built = (key, build_registry(gauges=gauges, multiproc=where))
            DEFAULT_REGISTRY.put("django.metrics.built", _built)
        return _built[1]
