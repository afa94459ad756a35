"""The errors a run can fail with when it asks for a slot.

Every error extends :class:`ConcurrencyError` and carries the limiter, the workload
and the run lineage (``run_id``, ``root_run_id``, ``parent_run_id``) plus the
``request_id`` of the slot request, so a log line or an alert can name the run
that failed without the caller adding anything::

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
    """Base class: a run could not get or keep a slot.

    :param message: what happened, naming the value at fault.
    :param limiter: name of the limiter, when one was chosen.
    :param workload: name of the workload, when one was chosen.
    :param run_id: the run that asked for the slot.
    :param root_run_id: the outermost run of the same tree.
    :param parent_run_id: the run that started this one, if any.
    :param request_id: the slot request that failed.
    """

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

    def __reduce__(self) -> tuple[object, ...]:
        # Keep the fields when the error crosses a process boundary (Celery results,
        # multiprocessing); the default pickling would pass only ``message``.
        return (_rebuild, (type(self), self.message, self.fields()))

    def fields(self) -> dict[str, str | None]:
        """Return the identifying fields, for logs and events."""
        return {
            "limiter": self.limiter,
            "workload": self.workload,
            "run_id": self.run_id,
            "root_run_id": self.root_run_id,
            "parent_run_id": self.parent_run_id,
            "request_id": self.request_id,
        }


def _rebuild(
    cls: type[ConcurrencyError], message: str, fields: dict[str, str | None]
) -> ConcurrencyError:
    return cls(message, **fields)


class ConcurrencyTimeoutError(ConcurrencyError):
    """No slot was granted before the workload's ``max_wait_ms`` or the run's budget."""


class ConcurrencyQueueFullError(ConcurrencyError):
    """The limiter already has ``max_queued`` waiting requests."""


class ConcurrencyLimiterError(ConcurrencyError):
    """The limiter failed (for example its database is unreachable); no slot is granted."""


class ConcurrencyConfigError(ConcurrencyError):
    """Invalid settings, an unknown workload, or limits that differ between workers."""


class ConcurrencyHeaderError(ConcurrencyConfigError):
    """A task message carries a ``runcell_*`` header that is not what a sender writes.

    A configuration error of the message rather than of the settings: the run never
    starts (its body does not run) and the message names the header and the value.
    A subclass of :class:`ConcurrencyConfigError`, so code that stops on bad
    configuration stops on it too.
    """


class ConcurrencyNoLimiterError(ConcurrencyConfigError):
    """``slot()`` named no limiter and its run has none (or there is no run).

    Its own class so a layer that knows why the run has none (a Celery task declared
    with ``concurrency={}``) can say so, naming the task and what to add.
    """


class ConcurrencyLeaseLostError(ConcurrencyError):
    """The slot was lost while held: renewal failed past expiry, or ``max_hold_ms`` passed.

    The provider call that ran under the slot is aborted and its result is never
    returned as a success.
    """


class ConcurrencyCancelledError(ConcurrencyError):
    """The run was cancelled while it waited for a slot or held one."""
