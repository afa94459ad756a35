"""Is anyone tracing? The one question the core asks of OpenTelemetry (the spans are
:mod:`runcell_celery.tracing`'s; a request asks here whether to find its place in line).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from .background import DEFAULT_REGISTRY
from .version import __version__

try:
    from opentelemetry import trace as otel_trace

    OTEL_AVAILABLE = True
except ImportError:  # the "otel" extra is not installed: no spans, ever
    OTEL_AVAILABLE = False

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer

__all__ = ["OTEL_AVAILABLE", "current_tracer"]


def _no_provider() -> object:
    return None


def _global_provider() -> object:
    # The API's own "is a provider set" global: None until set_tracer_provider(). Read
    # instead of get_tracer_provider(), which pays a failed os.environ lookup (about
    # half a microsecond) on every call while none is set.
    return otel_trace._TRACER_PROVIDER


if not OTEL_AVAILABLE:
    _peek: Callable[[], object] = _no_provider
elif hasattr(otel_trace, "_TRACER_PROVIDER"):
    _peek = _global_provider
else:  # an API that renamed its global: ask it every time (right, a little slower)
    _peek = otel_trace.get_tracer_provider

#: (what _peek() returned, the tracer chosen then) before any lookup.
_UNKNOWN: tuple[object, Tracer | None] = (object() if OTEL_AVAILABLE else None, None)


def current_tracer() -> Tracer | None:
    """The tracer for runcell's spans; ``None`` without ``opentelemetry-api`` or while
    the provider is the API's proxy or a no-op (cached until the provider changes)."""
    seen, tracer = DEFAULT_REGISTRY.value("tracer", _UNKNOWN)
    if _peek() is seen:
        return tracer
    # get_tracer_provider() also loads a provider named by OTEL_PYTHON_TRACER_PROVIDER.
    provider = otel_trace.get_tracer_provider()
    tracer = None
    if not isinstance(provider, otel_trace.ProxyTracerProvider | otel_trace.NoOpTracerProvider):
        tracer = provider.get_tracer("runcell_celery", __version__)
    DEFAULT_REGISTRY.put("tracer", (_peek(), tracer))
    return tracer
