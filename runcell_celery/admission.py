"""How a run's first slot is admitted, decided before the run's body runs.

By default a slot request waits (up to its deadline) when the body asks for it. A job
system can do better for a run's *first* slot: Celery's admission deferral decides it
before the task body starts (:func:`runcell_celery.slot.preadmit`). Either the run is
parked — :class:`SlotDeferred` reaches the job system, never user code, and the body
does not run — or it is granted a slot that waits for the body as a
:class:`PreAdmitted` slot:

* the process's lease keeper renews it like any held lease;
* the first ``slot()`` the run asks for (in the run or in a child run of this process)
  **adopts** it when it names the same limiter and workload: no second acquire, no
  round trip; the hold, with its events, starts there;
* a first ``slot()`` that names another limiter or workload does not adopt it, and
  **releases it first**: a run never keeps an idle slot while it waits for another
  one (two slots of one limiter held by one run could wait on each other);
* a lease lost meanwhile (renewal failed, released by an operator) makes the adopting
  ``slot()`` raise :class:`~runcell_celery.errors.ConcurrencyLeaseLostError`, as a
  held slot's would; cancellation or the end of the run's budget releases it;
* if the body never adopts it, it is released when the run ends.

The core knows nothing about Celery: a run carries an :class:`Admission` whose
``acquire`` replaces ``limiter.acquire`` for that first slot.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Literal

from .cancellation import CancellationToken
from .deadline import Deadline
from .events import describe_error
from .hold import outcome_of
from .keeper import LeaseKeeper, get_keeper
from .ports import Parked
from .protocol import AcquireRequest, ConcurrencyLimiter, Lease, OnWait, Outcome
from .request import SlotRequest

__all__ = ["Admission", "AdmissionAcquire", "PreAdmitted", "SlotDeferred"]

logger = logging.getLogger("runcell_celery.admission")

AdmissionAcquire = Callable[
    [ConcurrencyLimiter, AcquireRequest, CancellationToken | None, OnWait], Lease
]


class SlotDeferred(BaseException):
    """The run's first slot was deferred: the run is parked, not failed.

    Raised by an :class:`Admission`'s ``acquire`` into the job system that decides
    admission before the run's body (never out of ``slot()``). A ``BaseException`` so
    that an ``except Exception`` between the two cannot mistake it for an error.
    """


class PreAdmitted:
    """A run's first slot, granted before its body ran and not used yet.

    It is the lease keeper's :class:`~runcell_celery.keeper.LeaseHolder` until it is
    adopted by a slot (which keeps the lease from then on), released, or lost. Emits
    no events of its own: ``acquired`` and ``released`` describe provider requests,
    and belong to the slot that adopts it.
    """

    def __init__(self, slot_request: SlotRequest, lease: Lease, *, wait_ms: float) -> None:
        self.slot_request = slot_request
        self.lease = lease
        #: How long the admission waited for the grant (in this delivery).
        self.wait_ms = wait_ms
        self._lock = threading.Lock()
        self._state: Literal["held", "adopted", "released", "lost"] = "held"
        self._keeper: LeaseKeeper | None = None
        self._key = 0
        self._detach: Callable[[], object] | None = None

    def keep(self, deadline: Deadline | None, cancel: CancellationToken | None) -> None:
        """Hand the lease to the keeper; release it if ``deadline`` passes or ``cancel``
        is set before a slot adopts it."""
        self._keeper = get_keeper()
        self._key = self._keeper.keep(self, self.lease.ttl_ms, deadline, self.lease.valid_until)
        if cancel is not None:
            self._detach = cancel.add_callback(self.cancelled)

    def hand_over(self) -> Literal["held", "lost"] | None:
        """Stop keeping the lease, for the slot that adopts it.

        :returns: ``"held"`` (the slot holds :attr:`lease` from now on), ``"lost"``
            (the lease could not be renewed: the slot must fail as a lost lease), or
            ``None`` (already released: the slot asks for one of its own).
        """
        with self._lock:
            state = self._state
            if state not in ("held", "lost"):
                return None
            self._state = "adopted"
        self._stop()
        return state

    def release(self, outcome: Outcome) -> None:
        """Give the slot back unused (once; nothing if adopted or released already)."""
        with self._lock:
            state = self._state
            if state not in ("held", "lost"):
                return
            self._state = "released"
        self._stop()
        lease = self.lease
        try:
            self.slot_request.limiter.release(lease, "lease-lost" if state == "lost" else outcome)
        except Exception as exc:  # the lease TTL returns the slot
            logger.warning("releasing %s failed: %s", lease.lease_id, describe_error(exc))
            self.slot_request.event(
                "release-failed", lease_id=lease.lease_id, error=describe_error(exc)
            )

    def _stop(self) -> None:
        if self._keeper is not None:
            self._keeper.forget(self._key)
        if self._detach is not None:
            self._detach()
            self._detach = None

    # -- what the keeper and a cancelling thread tell it --------------------------------

    def kept_lease(self) -> tuple[ConcurrencyLimiter, Lease] | None:
        if self._state != "held":
            return None
        return self.slot_request.limiter, self.lease

    def lease_renewed(self, lease: Lease) -> None:
        self.lease = lease

    def renewal_failed(self, error: BaseException) -> None:
        logger.warning(
            "renewing pre-admitted slot %s failed: %s", self.lease.lease_id, describe_error(error)
        )

    def lease_lost(self, error: BaseException | None) -> None:
        with self._lock:
            if self._state != "held":
                return
            self._state = "lost"
        logger.warning(
            "pre-admitted slot %s of limiter %r was lost before the body used it",
            self.lease.lease_id,
            self.slot_request.limiter.name,
        )

    def deadline_passed(self) -> Deadline | None:
        self.release("timed-out")
        return None

    def cancelled(self) -> None:
        self.release("cancelled")


class Admission:
    """A one-shot replacement for ``limiter.acquire``, for the first slot of a run.

    :param acquire: called as ``acquire(limiter, request, cancel, on_wait)``; returns
        a lease or raises (:class:`SlotDeferred` to park the run).
    :param limiter: the limiter it applies to.
    :param request_id: the request id to use, stable across deliveries of the same
        run so a re-delivered run finds the place (or the lease) it already has.

    Once granted, :attr:`admitted` holds the slot until the run's first ``slot()``
    (:meth:`first_slot`) or the run's end (:meth:`end`).
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
        #: The granted first slot, until a slot takes it or the run ends.
        self.admitted: PreAdmitted | None = None
        self._consumed = False
        self._lock = threading.Lock()

    def hold(
        self,
        admitted: PreAdmitted,
        deadline: Deadline | None,
        cancel: CancellationToken | None,
    ) -> None:
        """Keep the granted first slot for the run's first ``slot()``."""
        self.admitted = admitted
        admitted.keep(deadline, cancel)

    def first_slot(self, limiter: ConcurrencyLimiter, workload: str) -> PreAdmitted | None:
        """For the run's first slot request: the pre-admitted slot it adopts, or ``None``.

        Only the first call after the grant sees it. If that request names another
        limiter or workload, the pre-admitted slot is released here, before the
        request waits for its own (outcome ``cancelled``).
        """
        admitted = self.admitted
        if admitted is None or not self._consume():
            return None
        if limiter is self.limiter and workload == admitted.slot_request.request.workload:
            return admitted
        admitted.release("cancelled")
        return None

    def end(self, exc: BaseException | None) -> None:
        """The run ended (``exc``: what its body raised): release a slot no request
        adopted, with the outcome that ending gives."""
        admitted = self.admitted
        if admitted is not None:
            self._consume()
            admitted.release(outcome_of(exc))

    def _consume(self) -> bool:
        """Mark the pre-admitted slot as given to a request; ``False`` if it was."""
        if self._consumed:  # the hot path of every later slot: no lock
            return False
        with self._lock:
            first = not self._consumed
            self._consumed = True
        return first
