"""What every limiter built on a :class:`~runcell_celery.config.LimiterConfig` shares,
without I/O: limits, workloads, how long a request may wait, and its errors, worded
the same whichever backend raises them."""

from __future__ import annotations

from .config import LimiterConfig
from .errors import (
    ConcurrencyCancelledError,
    ConcurrencyConfigError,
    ConcurrencyQueueFullError,
    ConcurrencyTimeoutError,
)
from .protocol import AcquireRequest

__all__ = ["ConfiguredLimiter"]


class ConfiguredLimiter:
    """Base class of the built-in limiters: limits, workloads, request errors."""

    def __init__(self, config: LimiterConfig) -> None:
        self._config = config

    def __repr__(self) -> str:
        config = self._config
        return f"<{type(self).__name__} {config.name!r} max={config.max_concurrent}>"

    @property
    def name(self) -> str:
        return self._config.name

    @property
    def config(self) -> LimiterConfig:
        return self._config

    def validate_workload(self, workload: str | None) -> str:
        """Return the workload a request uses; raise if it names none that exists."""
        return self._config.resolve_workload(workload)

    def _resolve(self, request: AcquireRequest) -> str:
        try:
            return self._config.resolve_workload(request.workload)
        except ConcurrencyConfigError as exc:
            raise request.error(ConcurrencyConfigError, exc.message, limiter=self.name) from None

    def _wait_ms(self, request: AcquireRequest, workload: str) -> float | None:
        """The longest this request may wait; ``None``: as long as it takes."""
        limits = [request.timeout_ms, self._config.workloads[workload].max_wait_ms]
        given = [x for x in limits if x is not None]
        return max(0.0, min(given)) if given else None

    def _timed_out(self, request: AcquireRequest, wait_ms: float | None) -> ConcurrencyTimeoutError:
        shown = "no time" if wait_ms is None else f"{wait_ms:g} ms"
        return request.error(
            ConcurrencyTimeoutError,
            f"no slot in limiter {self.name!r} (workload {request.workload!r}) within {shown}",
            limiter=self.name,
        )

    def _queue_full(self, request: AcquireRequest) -> ConcurrencyQueueFullError:
        max_queued = self._config.max_queued
        return request.error(
            ConcurrencyQueueFullError,
            f"limiter {self.name!r} already has {max_queued} waiting requests "
            f"(max_queued={max_queued})",
            limiter=self.name,
        )

    def _cancelled(self, request: AcquireRequest) -> ConcurrencyCancelledError:
        return request.error(
            ConcurrencyCancelledError,
            f"cancelled while waiting for a slot in limiter {self.name!r}",
            limiter=self.name,
        )
