"""How a run's first slot is admitted, decided before the run's body runs.

A job system can decide a run's *first* slot before its body starts (Celery's
admission deferral, :func:`runcell_celery.slot.preadmit`). The outcome is a value: the
run is parked (:class:`Deferred`: the body does not run), another delivery carries it
(:class:`DuplicateDelivery`), or it is granted a :class:`PreAdmitted` slot, renewed by
the lease keeper until the run's first ``slot()`` **adopts** it (same limiters and
workloads: no second acquire). A first ``slot()`` asking for anything else **releases
it first** (a run never keeps an idle slot while it waits for another: two slots of
one limiter held by one run could wait on each other). A lease lost meanwhile (even
by a pause past its validity) makes the adopting ``slot()`` raise
:class:`~runcell_celery.errors.ConcurrencyLeaseLostError`; cancellation, the end of the
budget or the end of the run releases it. The core knows nothing about Celery.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from .cancellation import CancellationToken
from .deadline import Deadline
from .events import describe_error
from .hold import KeptLeases, outcome_of
from .ports import Parked
from .protocol import ConcurrencyLimiter, Lease, Member, OnWait, Outcome
from .request import SlotRequest

__all__ = [
    "Admission",
    "AdmissionAcquire",
    "Deferred",
    "DuplicateDelivery",
    "PreAdmitted",
]

logger = logging.getLogger("runcell_celery.admission")


@dataclass(frozen=True)
class Deferred:
    """The run's first slot was deferred: the run is parked, not failed.

    An outcome of an :class:`Admission`'s ``acquire`` and of
    :func:`~runcell_celery.slot.preadmit`, for the job system (never out of ``slot()``).
    ``parked``: where it waits (its place and expected wait), for its log line, when the
    limiter told.
    """

    parked: Parked | None = None


@dataclass(frozen=True)
class DuplicateDelivery:
    """Another delivery of this run owns its place or its granted lease (or the task
    already has a result): the job system drops this delivery. An outcome, like
    :class:`Deferred`."""


#: How an admission asks: ``acquire(members, cancel, on_wait)``; the leases in the
#: members' order (granted together), or why the run does not start here.
AdmissionAcquire = Callable[
    [tuple[Member, ...], CancellationToken | None, OnWait],
    Sequence[Lease] | Deferred | DuplicateDelivery,
]


class PreAdmitted(KeptLeases):
    """A run's first slot (one lease per limiter), granted before its body ran and not
    used yet: kept until a slot adopts the leases, they are released, or one is lost.
    Emits no events of its own: ``acquired`` and ``released`` belong to the slot that
    adopts it."""

    def __init__(
        self, slot_request: SlotRequest, leases: Sequence[Lease], *, wait_ms: float
    ) -> None:
        super().__init__(slot_request, leases)
        #: The run's whole wait for the grant (a parked run's since its first delivery).
        self.wait_ms = wait_ms
        self._lock = threading.Lock()
        self._state: Literal["held", "adopted", "released", "lost"] = "held"
        self._detach: Callable[[], object] | None = None

    def keep(self, deadline: Deadline | None, cancel: CancellationToken | None) -> None:
        """Hand the leases to the keeper; release them if ``deadline`` passes or
        ``cancel`` is set before a slot adopts them."""
        self._valid_from_now()
        self._keep(deadline)
        if cancel is not None:
            self._detach = cancel.add_callback(self.cancelled)

    def hand_over(self) -> Literal["held", "lost"] | None:
        """Stop keeping the leases, for the slot that adopts them.

        :returns: ``"held"`` (the slot holds :attr:`leases` from now on), ``"lost"``
            (a lease could not be renewed, or its local validity has passed: the slot
            must fail as a lost lease), or ``None`` (already released: the slot asks
            for its own).
        """
        self._check_validity()
        with self._lock:
            state = self._state
            if state not in ("held", "lost"):
                return None
            self._state = "adopted"
        self._stop()
        return state

    def release(self, outcome: Outcome) -> None:
        """Give the slots back unused (once; nothing if adopted or released already)."""
        self._check_validity()
        with self._lock:
            state = self._state
            if state not in ("held", "lost"):
                return
            self._state = "released"
        self._stop()
        self._release_all("lease-lost" if state == "lost" else outcome)

    def _check_validity(self) -> None:
        """Take a lease whose local validity has passed for lost, as the keeper would."""
        index = self._first_invalid() if self._state == "held" else None
        if index is not None:
            self.part_lost(index, None)

    def _stop(self) -> None:
        self._forget()
        if self._detach is not None:
            self._detach()
            self._detach = None

    # -- what the keeper (through each part) and a cancelling thread tell it ------------

    def part_lease(self, index: int) -> tuple[ConcurrencyLimiter, Lease] | None:
        if self._state != "held":
            return None
        return self.limiters[index], self.leases[index]

    def part_renewal_failed(self, index: int, error: BaseException) -> None:
        logger.warning("renewing a pre-admitted slot failed: %s", describe_error(error))

    def part_lost(self, index: int, error: BaseException | None) -> None:
        with self._lock:
            if self._state != "held":
                return
            self._state = "lost"
        logger.warning(
            "pre-admitted slot %s of limiter %r was lost before the body used it",
            self.leases[index].lease_id,
            self.limiters[index].name,
        )

    def deadline_passed(self) -> Deadline | None:
        self.release("timed-out")
        return None

    def cancelled(self) -> None:
        self.release("cancelled")


class Admission:
    """A one-shot replacement for ``acquire``, for the first slot of a run.

    :param acquire: an :data:`AdmissionAcquire`; returns the leases, :class:`Deferred`
        (the run parked) or :class:`DuplicateDelivery`, or raises a concurrency error.
    :param limiters: the run's limiters, in its order (one, or several granted
        together); ``limiter`` is the first.
    :param request_id: the request id to use, stable across deliveries of the same
        run so a re-delivered run finds the place (or the lease) it already has.

    Once granted, :attr:`admitted` holds the slot (or slots) until the run's first
    ``slot()`` (:meth:`first_slot`) or the run's end (:meth:`end`).
    """

    def __init__(
        self,
        acquire: AdmissionAcquire,
        *,
        limiters: Sequence[ConcurrencyLimiter],
        request_id: str,
    ) -> None:
        if not limiters:
            raise ValueError("an admission needs at least one limiter")
        self.acquire = acquire
        self.limiters: tuple[ConcurrencyLimiter, ...] = tuple(limiters)
        self.limiter = self.limiters[0]
        self.request_id = request_id
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

    def first_slot(
        self, limiters: Sequence[ConcurrencyLimiter], workloads: Sequence[str]
    ) -> PreAdmitted | None:
        """For the run's first slot request: the pre-admitted slots it adopts, or ``None``.

        Only the first call after the grant sees them. A request adopts slots admitted
        over the same limiters, each with the same workload (in any order); if it names
        anything else, the pre-admitted slots are released here, before the request
        waits for its own (outcome ``cancelled``).
        """
        admitted = self.admitted
        if admitted is None or not self._consume():
            return None
        asked = {id(x): w for x, w in zip(limiters, workloads, strict=True)}
        held = admitted.slot_request.requests
        have = {id(x): r.workload for x, r in zip(admitted.limiters, held, strict=True)}
        if len(asked) == len(limiters) and asked == have:
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
