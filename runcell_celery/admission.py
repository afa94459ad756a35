"""How a run's first slot is admitted, when a job system wants more than waiting.

By default a slot request waits (up to its deadline). A job system can do better
for a run's *first* slot: Celery's admission deferral parks the task instead of
blocking a worker process, and re-publishes it when a slot frees. The core knows
nothing about Celery; it only lets a run carry an :class:`Admission` whose
``acquire`` replaces ``limiter.acquire`` for the run's first slot, once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from .cancellation import CancellationToken
from .ports import Parked
from .protocol import AcquireRequest, ConcurrencyLimiter, Lease, OnWait

__all__ = ["Admission", "AdmissionAcquire", "SlotDeferred"]

AdmissionAcquire = Callable[
    [ConcurrencyLimiter, AcquireRequest, CancellationToken | None, OnWait], Lease
]


class SlotDeferred(BaseException):
    """The run's first slot was deferred: the run is parked, not failed.

    A ``BaseException`` so that ``except Exception`` in task code (and Celery's
    ``autoretry_for``) never mistakes it for an error; the job system that set the
    :class:`Admission` catches it.
    """


class Admission:
    """A one-shot replacement for ``limiter.acquire``, for the first slot of a run.

    :param acquire: called as ``acquire(limiter, request, cancel, on_wait)``; returns
        a lease or raises (:class:`SlotDeferred` to park the run).
    :param limiter: the limiter it applies to; slots of other limiters wait as usual.
    :param request_id: the request id to use, stable across deliveries of the same
        run so a re-delivered run finds the place (or the lease) it already has.
    """

    def __init__(
        self, acquire: AdmissionAcquire, *, limiter: ConcurrencyLimiter, request_id: str
    ) -> None:
        self.acquire = acquire
        self.limiter = limiter
        self.request_id = request_id
        #: Set by the job system when the run parked: where it waits (its place and
        #: expected wait, see :class:`~runcell_celery.ports.Parked`), for its log line.
        self.parked: Parked | None = None
        self._taken = False
        self._lock = threading.Lock()

    def take(self, limiter: ConcurrencyLimiter) -> Admission | None:
        """Return this admission for the run's first slot on its limiter, then never."""
        if limiter is not self.limiter:
            return None
        with self._lock:
            if self._taken:
                return None
            self._taken = True
            return self
