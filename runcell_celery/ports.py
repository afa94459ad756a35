"""The seams between layers: what the integration layers may ask of a backend.

A layer asks ``isinstance(backend, RunStore)``, never reads the backend's tables; the
values traded across these seams live here, so no layer imports another's internals.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Literal, Protocol, runtime_checkable

from .cancellation import CancellationToken
from .config import LimiterConfig
from .protocol import ConcurrencyLimiter, Lease, Member, OnWait

__all__ = [
    "COUNT_FIELDS",
    "DEFAULT_DEFER_AFTER_MS",
    "AdmissionCount",
    "Backend",
    "BackendFactory",
    "ClaimMiss",
    "CounterStore",
    "Duplicate",
    "ExpiredParked",
    "GreenIOCheck",
    "LimitsConflict",
    "Parked",
    "ParkingStore",
    "Republish",
    "RevocationStore",
    "RunStore",
    "StoredLimitsCheck",
    "SupportsParking",
    "WaitEstimate",
]

#: A deferrable request parks when its expected wait exceeds this (ms), else waits at
#: most this long first: a parked grant holds its slot idle while the message travels
#: back through the broker, so blocking briefly is cheaper for short waits.
DEFAULT_DEFER_AFTER_MS = 1_000.0


@runtime_checkable
class Backend(Protocol):
    """Where a registry's limiters live; built once per registry and process."""

    def create_limiter(self, config: LimiterConfig) -> ConcurrencyLimiter: ...

    def close(self) -> None: ...


class BackendFactory(Protocol):
    """A backend class: validates its options section (at ``path``, errors name it)."""

    def __call__(
        self, *, database: str | None, options: Mapping[str, Any], path: str
    ) -> Backend: ...


@dataclass(frozen=True, slots=True)
class AdmissionCount:
    """Fleet-wide admission counts for one task name and limiter."""

    task_name: str
    limiter: str
    deliveries: int = 0
    deferrals: int = 0
    provider_attempts: int = 0
    provider_failures: int = 0
    concurrency_failures: int = 0


#: The counts of an :class:`AdmissionCount`, in order (after its task name and limiter).
COUNT_FIELDS = tuple(field.name for field in fields(AdmissionCount))[2:]


@dataclass(frozen=True, slots=True)
class WaitEstimate:
    """How long a request that joined a line is likely to wait: with all ``slots``
    held, one frees every ``hold_ms / slots``, and it waits for ``ahead + 1`` of them."""

    ahead: int
    hold_ms: float | None
    slots: int

    @property
    def place(self) -> int:
        return self.ahead + 1

    @property
    def expected_ms(self) -> float | None:
        if self.hold_ms is None or self.slots <= 0:
            return None
        return self.place * self.hold_ms / self.slots


@dataclass(frozen=True)
class Duplicate:
    """``acquire_or_park``: already parked and granted; its publication carries it."""


@dataclass(frozen=True, kw_only=True)
class Parked:
    """``acquire_or_park``: the request was parked (where, for a deferral's log line)."""

    limiter: str
    workload: str
    estimate: WaitEstimate | None = None
    waited_ms: float = 0.0

    @property
    def place(self) -> int | None:
        return self.estimate.place if self.estimate is not None else None

    @property
    def expected_wait_ms(self) -> float | None:
        return self.estimate.expected_ms if self.estimate is not None else None


@dataclass(frozen=True, slots=True)
class Republish:
    """A granted parked request whose task message this process must publish."""

    limiter: str
    request_id: str
    publication_id: str
    payload: str


#: Why ``claim_parked`` gave no lease: ``"stale"`` (still stored: this message is an
#: outdated copy) or ``"missing"`` (nothing stored: claimed by another copy, or ended).
ClaimMiss = Literal["stale", "missing"]


@dataclass(frozen=True, slots=True)
class ExpiredParked:
    """A parked request past its deadline, stored until its failure is recorded."""

    limiter: str
    request_id: str
    workload: str
    run_id: str | None
    root_run_id: str | None
    parent_run_id: str | None
    holder_name: str | None
    payload: str
    waited_ms: float | None = None


@dataclass(frozen=True, slots=True)
class LimitsConflict:
    """``differences``: ``max_concurrent (stored 2, given 3)``."""

    limiter: str
    differences: str


@runtime_checkable
class StoredLimitsCheck(Protocol):
    """Compares a worker's limits with the stored ones before it serves anything."""

    def limit_conflicts(self, configs: Sequence[LimiterConfig]) -> list[LimitsConflict]: ...


@runtime_checkable
class GreenIOCheck(Protocol):
    """Says, before a gevent worker serves anything, why the backend's I/O would block
    the gevent hub (every greenlet of the process) even though the process is patched."""

    def green_io_problem(self) -> str | None:
        """What blocks and how to fix it, or ``None`` when every wait yields."""
        ...


@runtime_checkable
class RunStore(Protocol):
    """Records when each run first started, so its budget survives redelivery."""

    def first_start(self, run_id: str, timeout_ms: float) -> float:
        """The milliseconds left in its budget, on the store's clock (not this host's)."""
        ...


@runtime_checkable
class RevocationStore(Protocol):
    """Revoked runs, shared by every worker so a revoked root stops its children."""

    def add_revoked(self, run_ids: Sequence[str]) -> int: ...

    def revoked_among(self, run_ids: Iterable[str]) -> set[str]: ...

    def purge_revoked(self, keep_ms: int) -> int: ...


@runtime_checkable
class CounterStore(Protocol):
    """Fleet-wide admission counters (deliveries, deferrals, failures)."""

    def add_counts(self, counts: Sequence[AdmissionCount], *, batch_id: str | None = None) -> None:
        """A batch sent again with the same ``batch_id`` is added once."""
        ...

    def admission_counts(self) -> list[AdmissionCount]: ...


@runtime_checkable
class ParkingStore(Protocol):
    """Parked tasks whose messages must be re-published (Celery admission deferral)."""

    def claim_republish(
        self,
        lease_ids: Sequence[str] = (),
        *,
        stale_ms: int,
        broker: str | None = None,
        others: set[str] | None = None,
    ) -> list[Republish]:
        """Take the right to publish grants, one caller each: ``lease_ids`` and any
        nobody published within ``stale_ms`` (other brokers' go into ``others``)."""
        ...

    def unclaim_republish(self, items: Sequence[Republish]) -> int: ...

    def take_expired_parked(self, *, broker: str | None = None) -> list[ExpiredParked]:
        """Phase one: take expired parked requests out of line (still stored)."""
        ...

    def complete_expired_parked(self, expired: Sequence[ExpiredParked]) -> int:
        """Phase two: delete those whose failure is recorded; idempotent."""
        ...

    def on_parked_granted(self, handler: Callable[[str, list[str]], None]) -> None: ...

    def pass_parked_groups(self) -> list[str]:
        """Grant parked requests over several limiters; return the lease ids granted."""
        ...


@runtime_checkable
class SupportsParking(Protocol):
    """A backend whose waiting requests can be parked with a task message, asked through
    the first member's limiter; a request over several members parks as one (granted
    together, claimed all or none). ``acquire_or_park`` waits ``admission_wait_ms``, or
    by default parks at once when the expected wait exceeds ``defer_after_ms``, else
    waits that long first. ``claim_parked`` and ``withdraw_members`` are idempotent
    under lost replies; the granted handler is called after commit with lease ids."""

    def acquire_or_park(
        self,
        members: Sequence[Member],
        *,
        payload: str,
        broker: str | None = None,
        admission_wait_ms: float | None = None,
        defer_after_ms: float = DEFAULT_DEFER_AFTER_MS,
        cancel: CancellationToken | None = None,
        on_wait: OnWait | None = None,
    ) -> tuple[Lease, ...] | Parked | Duplicate: ...

    def claim_parked(
        self, limiters: Sequence[ConcurrencyLimiter], request_id: str, publication_id: str
    ) -> tuple[Lease, ...] | ClaimMiss: ...

    def withdraw_members(self, limiters: Sequence[ConcurrencyLimiter], request_id: str) -> None: ...

    def set_parked_granted_handler(self, handler: Callable[[list[str]], None] | None) -> None: ...
