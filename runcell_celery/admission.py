"""How a run's first slot is admitted, decided before the run's body runs.

By default a slot request waits (up to its deadline) when the body asks for it. A job
system can do better for a run's *first* slot: Celery's admission deferral decides it
before the task body starts (:func:`runcell_celery.slot.preadmit`). The outcome is a
value: the run is parked (:class:`Deferred`: the job system sets the delivery aside,
user code never sees it, and the body does not run), or another delivery carries it
(:class:`DuplicateDelivery`), or it is granted a slot that waits for the body as a
:class:`PreAdmitted` slot:

* the process's lease keeper renews it like any held lease;
* the first ``slot()`` the run asks for (in the run or in a child run of this process)
  **adopts** it when it names the same limiter and workload: no second acquire, no
  round trip; the hold, with its events, starts there;
* a first ``slot()`` that names another limiter or workload does not adopt it, and
  **releases it first**: a run never keeps an idle slot while it waits for another
  one (two slots of one limiter held by one run could wait on each other);
* a lease lost meanwhile (renewal failed, released by an operator, or its local
  validity passed while the process was paused, even if the keeper has not run
  since) makes the adopting ``slot()`` raise
  :class:`~runcell_celery.errors.ConcurrencyLeaseLostError`, as a held slot's would;
  cancellation or the end of the run's budget releases it;
* if the body never adopts it, it is released when the run ends.

The core knows nothing about Celery: a run carries an :class:`Admission` whose
``acquire`` replaces ``limiter.acquire`` for that first slot.
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
from .hold import LeasePart, outcome_of
from .keeper import LeaseKeeper, get_keeper, local_validity
from .ports import Parked
from .protocol import AcquireRequest, ConcurrencyLimiter, Lease, OnWait, Outcome
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


#: How an admission asks: ``acquire(limiters, requests, cancel, on_wait)``, one request
#: per limiter (a run over one limiter is a group of one); the leases in that order
#: (granted together), or why the run does not start here.
AdmissionAcquire = Callable[
    [
        tuple[ConcurrencyLimiter, ...],
        tuple[AcquireRequest, ...],
        CancellationToken | None,
        OnWait,
    ],
    Sequence[Lease] | Deferred | DuplicateDelivery,
]


class PreAdmitted:
    """A run's first slot, granted before its body ran and not used yet.

    One lease, or one per limiter for a run over several limiters (granted together,
    kept and given back together). Each lease is kept by the lease keeper through a
    :class:`~runcell_celery.hold.LeasePart` until a slot adopts them all (and keeps
    them from then on), they are released, or one is lost. Emits no events of its
    own: ``acquired`` and ``released`` describe provider requests, and belong to the
    slot that adopts it.
    """

    def __init__(
        self, slot_request: SlotRequest, lease: Lease | Sequence[Lease], *, wait_ms: float
    ) -> None:
        self.slot_request = slot_request
        #: The leases, in the order of :attr:`limiters`.
        self.leases: list[Lease] = [lease] if isinstance(lease, Lease) else list(lease)
        #: The run's whole wait for the grant: a parked run's counts from its first
        #: delivery's ask (the claim's database time), any other this delivery's.
        self.wait_ms = wait_ms
        self._lock = threading.Lock()
        self._state: Literal["held", "adopted", "released", "lost"] = "held"
        self._keeper: LeaseKeeper | None = None
        self._parts: list[LeasePart] = []
        self._keys: list[int] = []
        self._detach: Callable[[], object] | None = None
        #: The keeper's clock and each lease's local validity on it (set by keep).
        self._clock = get_keeper(slot_request.limiter).clock
        self._valid_until: list[float] = []

    @property
    def lease(self) -> Lease:
        """The first limiter's lease (the only one, for a run over one limiter)."""
        return self.leases[0]

    @property
    def limiters(self) -> tuple[ConcurrencyLimiter, ...]:
        """The limiters its leases belong to, in order."""
        request = self.slot_request
        return request.limiters

    def keep(self, deadline: Deadline | None, cancel: CancellationToken | None) -> None:
        """Hand the leases to the keeper; release them if ``deadline`` passes or
        ``cancel`` is set before a slot adopts them."""
        keeper = self._keeper = get_keeper(self.slot_request.limiter)
        self._clock = keeper.clock
        now = self._clock.monotonic()
        self._valid_until = [local_validity(lease, now).at for lease in self.leases]
        self._parts = [LeasePart(self, index) for index in range(len(self.leases))]
        self._keys = [
            keeper.keep(
                part,
                lease.ttl_ms,
                deadline if part.index == 0 else None,
                Deadline(self._valid_until[part.index]),
            )
            for part, lease in zip(self._parts, self.leases, strict=True)
        ]
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
        for limiter, lease in zip(self.limiters, list(self.leases), strict=True):
            try:
                limiter.release(lease, "lease-lost" if state == "lost" else outcome)
            except Exception as exc:  # the lease TTL returns the slot
                logger.warning("releasing %s failed: %s", lease.lease_id, describe_error(exc))
                self.slot_request.event(
                    "release-failed", lease_id=lease.lease_id, error=describe_error(exc)
                )

    def _check_validity(self) -> None:
        """Take a lease whose local validity has passed for lost, as the keeper would
        when it next runs (a process paused longer than the lease lives)."""
        if self._state != "held":
            return
        now = self._clock.monotonic()
        for index, valid_until in enumerate(self._valid_until):
            if now >= valid_until:
                self.part_lost(index, None)
                return

    def _stop(self) -> None:
        if self._keeper is not None:
            for key in self._keys:
                self._keeper.forget(key)
        if self._detach is not None:
            self._detach()
            self._detach = None

    # -- what the keeper (through each part) and a cancelling thread tell it ------------

    def part_lease(self, index: int) -> tuple[ConcurrencyLimiter, Lease] | None:
        if self._state != "held":
            return None
        return self.limiters[index], self.leases[index]

    def part_renewed(self, index: int, lease: Lease, valid_until: Deadline) -> None:
        self.leases[index] = lease
        self._valid_until[index] = valid_until.at

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

    :param acquire: called as ``acquire(limiters, requests, cancel, on_wait)``
        (:data:`AdmissionAcquire`); returns the leases, :class:`Deferred` (the run
        parked) or :class:`DuplicateDelivery`, or raises a concurrency error.
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
