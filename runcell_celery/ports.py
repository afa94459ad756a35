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
from typing import Any, Protocol, runtime_checkable

from .cancellation import CancellationToken
from .config import LimiterConfig
from .protocol import AcquireRequest, ConcurrencyLimiter, Lease, OnWait

__all__ = [
    "AdmissionCount",
    "Backend",
    "BackendFactory",
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


@dataclass(frozen=True, slots=True)
class ExpiredParked:
    """A parked request whose deadline passed before it was granted."""

    limiter: str
    request_id: str
    workload: str
    run_id: str | None
    root_run_id: str | None
    parent_run_id: str | None
    holder_name: str | None
    payload: str


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

    def take_expired_parked(self) -> list[ExpiredParked]: ...

    def on_parked_granted(self, handler: Callable[[str, list[str]], None]) -> None:
        """Call ``handler(limiter, request_ids)`` when any process grants parked
        requests (the backend's wake-up channel)."""
        ...


@runtime_checkable
class SupportsParking(Protocol):
    """A limiter whose waiting requests can be parked with a task message.

    ``acquire_or_park`` waits up to ``admission_wait_ms`` and then parks the request
    (it keeps its place in the queue with ``payload``); it returns the lease, or
    ``"parked"``, or ``"duplicate"`` when another delivery owns a lease granted to the
    request while it was parked. ``claim_parked`` takes a parked grant from the
    re-published message ``publication_id``. ``set_parked_granted_handler`` installs
    what to call, after commit, with the lease ids of parked requests this process
    just granted (to re-publish their tasks at once).
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

    def claim_parked(self, request_id: str, publication_id: str) -> Lease | None: ...

    def withdraw(self, request_id: str) -> None: ...

    def set_parked_granted_handler(self, handler: Callable[[list[str]], None] | None) -> None: ...
