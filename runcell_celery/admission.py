"""How a run's first slot is admitted, decided before the run's body runs.

The outcome is a value: parked (:class:`Deferred`), carried by another delivery
(:class:`DuplicateDelivery`), or a :class:`PreAdmitted` slot kept until the run's first
``slot()`` adopts it. A first ``slot()`` asking for anything else releases it first: two
slots of one limiter held by one run could wait on each other.
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
    """The run's first slot was deferred: the run is parked, not failed."""

    parked: Parked | None = None


@dataclass(frozen=True)
class DuplicateDelivery:
    """Another delivery of this run owns its place or lease, or already finished it."""


AdmissionAcquire = Callable[
    [tuple[Member, ...], CancellationToken | None, OnWait],
    Sequence[Lease] | Deferred | DuplicateDelivery,
]


class PreAdmitted(KeptLeases):
    """A run's first slot, granted before its body ran, kept until a slot adopts it.
    Emits no events: ``acquired`` and ``released`` belong to the adopting slot."""

    def __init__(
        self, slot_request: SlotRequest, leases: Sequence[Lease], *, wait_ms: float
    ) -> None:
        super().__init__(slot_request, leases)
        self.wait_ms = wait_ms
        self._lock = threading.Lock()
        self._state: Literal["held", "adopted", "released", "lost"] = "held"
        self._detach: Callable[[], object] | None = None

    def keep(self, deadline: Deadline | None, cancel: CancellationToken | None) -> None:
        self._keep(deadline)
        if cancel is not None:
            self._detach = cancel.add_callback(self.cancelled)

    def hand_over(self) -> Literal["held", "lost"] | None:
        """Stop keeping the leases for the adopting slot: ``"lost"`` (it fails as a lost
        lease), or ``None`` (already released: it asks for its own)."""
        return self._end("adopted")

    def release(self, outcome: Outcome) -> None:
        state = self._end("released")
        if state is not None:
            self._release_all("lease-lost" if state == "lost" else outcome)

    def _end(self, to: Literal["adopted", "released"]) -> Literal["held", "lost"] | None:
        self._check_validity()
        with self._lock:
            state = self._state
            if state not in ("held", "lost"):
                return None  # adopted or released already
            self._state = to
        self._stop()
        return state

    def _check_validity(self) -> None:
        index = self._first_invalid() if self._state == "held" else None
        if index is not None:
            self.lease_lost(index, None)

    def _stop(self) -> None:
        self._forget()
        if self._detach is not None:
            self._detach()
            self._detach = None

    def kept_lease(self, index: int) -> tuple[ConcurrencyLimiter, Lease] | None:
        return (self.limiters[index], self.leases[index]) if self._state == "held" else None

    def renewal_failed(self, index: int, error: BaseException) -> None:
        logger.warning("renewing a pre-admitted slot failed: %s", describe_error(error))

    def lease_lost(self, index: int, error: BaseException | None) -> None:
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
    """A one-shot replacement for ``acquire``, for the first slot of a run;
    ``request_id`` is stable across deliveries so a re-delivered run finds its place."""

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
        self.admitted: PreAdmitted | None = None
        self._consumed = False
        self._lock = threading.Lock()

    def first_slot(
        self, limiters: Sequence[ConcurrencyLimiter], workloads: Sequence[str]
    ) -> PreAdmitted | None:
        """For the run's first slot request: the pre-admitted slots if it names the same
        limiters and workloads (any order), else they are released before it waits."""
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
        """The run ended: release a slot no request adopted."""
        admitted = self.admitted
        if admitted is not None:
            self._consume()
            admitted.release(outcome_of(exc))

    def _consume(self) -> bool:
        if self._consumed:  # the hot path of every later slot: no lock
            return False
        with self._lock:
            first = not self._consumed
            self._consumed = True
        return first
