"""The errors a run can fail with when it asks for a slot.

Each carries the limiter, workload, run lineage and request id, so a log line or an
alert names the run that failed without the caller adding anything::

    ConcurrencyError
    ├── ConcurrencyTimeoutError      no slot before the deadline; provider not called
    ├── ConcurrencyQueueFullError    max_queued requests already wait; provider not called
    ├── ConcurrencyLimiterError      the limiter or its database failed; fails closed
    ├── ConcurrencyConfigError       invalid settings, unknown workload, conflicting limits
    │   ├── ConcurrencyHeaderError   a task message carries a malformed runcell header
    │   └── ConcurrencyNoLimiterError  slot() with no limiter, outside any run that has one
    ├── ConcurrencyLeaseLostError    the slot could not be kept (renewal, max_hold_ms)
    └── ConcurrencyCancelledError    the run was cancelled while it waited or held a slot

A run stops after any of them: none is a provider failure, so none is retried as one.
"""

from __future__ import annotations

__all__ = [
    "ConcurrencyCancelledError",
    "ConcurrencyConfigError",
    "ConcurrencyError",
    "ConcurrencyHeaderError",
    "ConcurrencyLeaseLostError",
    "ConcurrencyLimiterError",
    "ConcurrencyNoLimiterError",
    "ConcurrencyQueueFullError",
    "ConcurrencyTimeoutError",
]


class ConcurrencyError(Exception):
    """Base class: a run could not get or keep a slot (``message`` names the value at
    fault; the fields say which limiter, workload, run and request)."""

    def __init__(
        self,
        message: str,
        *,
        limiter: str | None = None,
        workload: str | None = None,
        run_id: str | None = None,
        root_run_id: str | None = None,
        parent_run_id: str | None = None,
        request_id: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.limiter = limiter
        self.workload = workload
        self.run_id = run_id
        self.root_run_id = root_run_id
        self.parent_run_id = parent_run_id
        self.request_id = request_id

    def fields(self) -> dict[str, str | None]:
        """The identifying fields, for logs and events."""
        names = ("limiter", "workload", "run_id", "root_run_id", "parent_run_id", "request_id")
        return {name: getattr(self, name) for name in names}


class ConcurrencyTimeoutError(ConcurrencyError):
    """No slot was granted before the workload's ``max_wait_ms`` or the run's budget."""


class ConcurrencyQueueFullError(ConcurrencyError):
    """The limiter already has ``max_queued`` waiting requests."""


class ConcurrencyLimiterError(ConcurrencyError):
    """The limiter failed (for example its database is unreachable); no slot is granted."""


class ConcurrencyConfigError(ConcurrencyError):
    """Invalid settings, an unknown workload, or limits that differ between workers."""


class ConcurrencyHeaderError(ConcurrencyConfigError):
    """A task message carries a malformed ``runcell_*`` header: the run never starts."""


class ConcurrencyNoLimiterError(ConcurrencyConfigError):
    """``slot()`` named no limiter and its run has none (its own class, so a layer
    that knows why, a Celery task, can say what to add)."""


class ConcurrencyLeaseLostError(ConcurrencyError):
    """The slot was lost while held (renewal failed past expiry, or ``max_hold_ms``):
    the call under it is aborted, never returned as a success."""


class ConcurrencyCancelledError(ConcurrencyError):
    """The run was cancelled while it waited for a slot or held one."""
