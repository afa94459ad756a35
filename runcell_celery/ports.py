"""The seams between layers: what the integration layers may ask of a backend.

A backend (``runcell_celery.memory``, ``runcell_celery.postgres``) is built once per
limiter registry from the registry's settings and owns its storage and connections.
It creates limiters from a :class:`~runcell_celery.config.LimiterConfig`, and it may
offer stores the Celery and Django layers use. Each store is a runtime-checkable
protocol: a layer asks ``isinstance(backend, RunStore)`` and uses the store, never
the backend's tables or modules. The values traded across these seams are defined
here too, so no layer imports another's internals to read them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

from .cancellation import CancellationToken
from .config import LimiterConfig
from .protocol import AcquireRequest, ConcurrencyLimiter, Lease, OnWait

__all__ = [
    "AdmissionCount",
    "Backend",
    "BackendFactory",
    "ClaimMiss",
    "CounterStore",
    "ExpiredParked",
    "ParkingStore",
    "Republish",
    "RevocationStore",
    "RunStore",
    "SupportsParking",
]


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
    """A backend class: validates its own options section and builds the backend.

    :param database: the ``DATABASE`` setting, resolved to what the backend takes
        (a DSN for PostgreSQL); ``None`` when not set.
    :param options: the backend's own settings section (``RUNCELL["POSTGRES"]``).
    :param path: the settings path of that section, for error messages.
    :raises ConcurrencyConfigError: naming the bad option's path and value.
    """

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
    """A parked request whose deadline passed before it was granted.

    It stays stored (out of line) until :meth:`ParkingStore.complete_expired_parked`,
    so its task's failure can be recorded first. ``run_id`` is the task id and
    ``holder_name`` the task name; ``waited_ms`` how long it was in line.
    """

    limiter: str
    request_id: str
    workload: str
    run_id: str | None
    root_run_id: str | None
    parent_run_id: str | None
    holder_name: str | None
    payload: str
    waited_ms: float | None = None


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

    def add_counts(self, counts: Sequence[AdmissionCount]) -> None: ...

    def admission_counts(self) -> list[AdmissionCount]: ...


@runtime_checkable
class ParkingStore(Protocol):
    """Parked tasks whose messages must be re-published (Celery admission deferral)."""

    def claim_republish(
        self, lease_ids: Sequence[str] = (), *, stale_ms: int
    ) -> list[Republish]: ...

    def take_expired_parked(self) -> list[ExpiredParked]:
        """Phase one of failing stale parked work: take the parked requests whose
        deadline passed out of line and hand them to this process. They stay stored;
        the same process gets them again at its next call until it completes them, and
        any other process once a while has passed (the taker died)."""
        ...

    def complete_expired_parked(self, expired: Sequence[ExpiredParked]) -> int:
        """Phase two: delete expired requests whose failure is recorded; return how
        many were still stored. Idempotent under lost replies."""
        ...

    def on_parked_granted(self, handler: Callable[[str, list[str]], None]) -> None:
        """Call ``handler(limiter, request_ids)`` when any process grants parked
        requests (the backend's wake-up channel)."""
        ...


@runtime_checkable
class SupportsParking(Protocol):
    """A limiter whose waiting requests can be parked with a task message.

    A request belongs to one delivery of a task, never to the task id alone: the
    caller gives every delivery a request id of its own, carried across re-publication.

    ``acquire_or_park`` waits up to ``admission_wait_ms`` and then parks the request
    (it keeps its place in the queue with ``payload``); it returns the lease, or
    ``"parked"``, or ``"duplicate"`` when the request was already parked and granted
    (its own publication carries it). ``claim_parked`` takes a parked grant from the
    re-published message ``publication_id``, or says why not (:data:`ClaimMiss`).
    ``withdraw`` gives up a request's place or unclaimed grant. Parking, claiming
    and withdrawing are idempotent under lost replies (a retry gets the first
    answer). ``set_parked_granted_handler`` installs what to call, after commit, with
    the lease ids of parked requests this process just granted (to re-publish their
    tasks at once).
    """

    def acquire_or_park(
        self,
        request: AcquireRequest,
        *,
        admission_wait_ms: float,
        payload: str,
        cancel: CancellationToken | None = None,
        on_wait: OnWait | None = None,
    ) -> Lease | str: ...

    def claim_parked(self, request_id: str, publication_id: str) -> Lease | ClaimMiss: ...

    def withdraw(self, request_id: str) -> None: ...

    def set_parked_granted_handler(self, handler: Callable[[list[str]], None] | None) -> None: ...
