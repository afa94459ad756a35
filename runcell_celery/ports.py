"""The seams between layers: what the integration layers may ask of a backend.

A backend is built once per limiter registry and owns its storage and connections; it
creates limiters and may offer stores (runtime-checkable protocols: a layer asks
``isinstance(backend, RunStore)``, never reads the backend's tables). The values
traded across these seams live here, so no layer imports another's internals.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

from .cancellation import CancellationToken
from .config import LimiterConfig
from .protocol import ConcurrencyLimiter, Lease, Member, OnWait

__all__ = [
    "DEFAULT_DEFER_AFTER_MS",
    "AdmissionCount",
    "Backend",
    "BackendFactory",
    "ClaimMiss",
    "CounterStore",
    "Duplicate",
    "ExpiredParked",
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
#: most this long first. A parked grant holds its slot idle while the message travels
#: back through the broker (tens of ms, more behind a backlog), so blocking up to a
#: second is cheaper for short waits.
DEFAULT_DEFER_AFTER_MS = 1_000.0


@runtime_checkable
class Backend(Protocol):
    """Where a registry's limiters live; built once per registry and process."""

    def create_limiter(self, config: LimiterConfig) -> ConcurrencyLimiter:
        """Build (and register, where the backend stores limits) a limiter."""
        ...

    def close(self) -> None:
        """Stop background work and close connections this process opened."""
        ...


class BackendFactory(Protocol):
    """A backend class: validates its options section (``RUNCELL["POSTGRES"]`` at
    ``path``) and builds the backend on ``database`` (a DSN, or ``None``); raises
    ``ConcurrencyConfigError`` naming the bad option's path and value."""

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


@dataclass(frozen=True, slots=True)
class WaitEstimate:
    """How long a request that joined a line is likely to wait, from the limiter's
    figures at that moment: with all ``slots`` of its workload held, one frees every
    ``hold_ms / slots`` on average, and it waits for ``ahead + 1`` of them
    (``expected_ms = (ahead + 1) * hold_ms / slots``). An estimate: priorities,
    reservations and varying holds move it. ``hold_ms`` is ``None`` before any release.
    """

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
    """An outcome of :meth:`SupportsParking.acquire_or_park`: this request was already
    parked and granted; the publication of its grant carries it, so this delivery ends."""


@dataclass(frozen=True, kw_only=True)
class Parked:
    """An outcome of :meth:`SupportsParking.acquire_or_park`: the request was parked;
    where it waits (``estimate``, when the limiter gave one) and how long it waited
    before it parked (``waited_ms``), for a deferral's log line."""

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


#: Why :meth:`SupportsParking.claim_parked` gave no lease: ``"stale"`` — the parked
#: request is still stored (in line, or granted to another publication), so this
#: message is an outdated copy and its own publication will carry the task;
#: ``"missing"`` — nothing is stored for it any more (another copy of the message
#: claimed it, or it was withdrawn or failed).
ClaimMiss = Literal["stale", "missing"]


@dataclass(frozen=True, slots=True)
class ExpiredParked:
    """A parked request whose deadline passed before it was granted; stored (out of
    line) until :meth:`ParkingStore.complete_expired_parked`, so its task's failure is
    recorded first. ``run_id`` is the task id, ``holder_name`` the task name."""

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
    """A limiter whose limits in a worker's settings differ from the stored ones
    (``differences``: ``max_concurrent (stored 2, given 3)``)."""

    limiter: str
    differences: str


@runtime_checkable
class StoredLimitsCheck(Protocol):
    """Compares a worker's limits with the stored ones before it serves anything."""

    def limit_conflicts(self, configs: Sequence[LimiterConfig]) -> list[LimitsConflict]:
        """The limiters of ``configs`` this backend would refuse to create (stored
        limits differ, ``on_conflict``); stores nothing."""
        ...


@runtime_checkable
class RunStore(Protocol):
    """Records when each run first started, so its budget survives redelivery."""

    def first_start(self, run_id: str, timeout_ms: float) -> float:
        """Record the run's first start (or find it); return the milliseconds left
        in its budget, measured on the store's clock (never this host's)."""
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
        """Add ``counts``; a batch sent again with the same ``batch_id`` (a retry after
        a lost reply) is added once."""
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
        """Take the right to publish grants to parked requests, one caller each: those
        of ``lease_ids`` and any nobody published within ``stale_ms``, parked for
        ``broker`` or for none (other brokers with grants due go into ``others``)."""
        ...

    def unclaim_republish(self, items: Sequence[Republish]) -> int:
        """Give back claimed publications that could not be sent (broker down)."""
        ...

    def take_expired_parked(self, *, broker: str | None = None) -> list[ExpiredParked]:
        """Phase one of failing stale parked work: take the expired parked requests
        (of ``broker``, or none) out of line for this process; they stay stored, handed
        again to it until completed, or to another once a while passed."""
        ...

    def complete_expired_parked(self, expired: Sequence[ExpiredParked]) -> int:
        """Phase two: delete those whose failure is recorded; idempotent."""
        ...

    def on_parked_granted(self, handler: Callable[[str, list[str]], None]) -> None:
        """Call ``handler(limiter, request_ids)`` when any process grants parked
        requests."""
        ...

    def pass_parked_groups(self) -> list[str]:
        """Try granting parked requests over several limiters (no process waits for
        them); returns the lease ids granted, to re-publish."""
        ...


@runtime_checkable
class SupportsParking(Protocol):
    """A backend whose waiting requests can be parked with a task message, asked
    through the first member's limiter; one request over one member or several parks
    as one (every limiter keeps its place, the message is re-published once when all
    its slots are granted together, and the claim takes every lease or none).

    A request belongs to one delivery of a task, never to the task id alone.
    ``acquire_or_park`` with ``admission_wait_ms`` waits that long, then parks; by
    default it parks at once when the expected wait (:class:`WaitEstimate`) exceeds
    ``defer_after_ms``, else waits up to ``defer_after_ms`` and then parks. ``broker``
    names where the message must be re-published (``None``: by anyone). It returns the
    leases (members' order), :class:`Parked`, or :class:`Duplicate` (already parked and
    granted: its own publication carries it). ``claim_parked`` takes a parked grant for
    the re-published message ``publication_id``, or says why not (:data:`ClaimMiss`);
    ``withdraw_members`` gives up a request's places or unclaimed grant. All three are
    idempotent under lost replies. ``set_parked_granted_handler`` installs what to call,
    after commit, with the lease ids of parked requests this process just granted.
    """

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
