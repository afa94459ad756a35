"""What a limiter is: the :class:`ConcurrencyLimiter` protocol and the values it trades.

The slot runtime owns the lifecycle (deadlines, renewal, release, events); a limiter
owns allocation, queue order and storage. Any object with ``name``, ``acquire``,
``renew`` and ``release`` can back a limit; further abilities (``stats``,
``renew_many``, ``acquire_members``, ...) are declared as the runtime-checkable
``Supports*`` protocols below and used when a limiter has them.

A custom limiter must allocate atomically, hand out leases that expire, make renewal
and release idempotent, never reuse a lease id and make ``acquire`` safe to cancel;
:func:`runcell_celery.conformance.concurrency_conformance_cases` checks all of that.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol, TypeVar, cast, runtime_checkable

from .cancellation import CancellationToken
from .deadline import Deadline
from .errors import ConcurrencyError

if TYPE_CHECKING:
    from .config import LimiterConfig

__all__ = [
    "AcquireRequest",
    "ConcurrencyLimiter",
    "KeyStats",
    "Lease",
    "LimiterStats",
    "Member",
    "OnWait",
    "OnWaitWithPlace",
    "Outcome",
    "QueuePlace",
    "RunAdmission",
    "RunLineage",
    "SupportsConfig",
    "SupportsKeys",
    "SupportsMembers",
    "SupportsMembersAsync",
    "SupportsReap",
    "SupportsReleaseExecutor",
    "SupportsRenewMany",
    "SupportsStats",
    "SupportsValidateWorkload",
    "WorkloadStats",
    "announce_wait",
    "supports",
    "wants_place",
]

#: How a hold ended, passed to :meth:`ConcurrencyLimiter.release` and in ``released``.
Outcome = Literal["success", "error", "cancelled", "timed-out", "max-hold", "lease-lost"]

#: Called by a limiter when a request must wait, with the wait's deadline as a
#: Unix timestamp (``None``: no deadline). The runtime emits ``wait-started`` from it.
#: A limiter that knows where the request joined the line tells it with
#: :func:`announce_wait` (to callbacks that are :class:`OnWaitWithPlace`).
OnWait = Callable[[float | None], None]

E = TypeVar("E", bound=ConcurrencyError)


@dataclass(frozen=True, slots=True)
class RunLineage:
    """Which run asked: its id, the root of its tree and its direct parent."""

    run_id: str
    root_run_id: str
    parent_run_id: str | None = None


@dataclass(frozen=True, slots=True)
class AcquireRequest:
    """One request for one slot.

    ``request_id`` is stable across retries of the request (Celery deferral re-uses
    it); ``timeout_ms`` is the run's remaining budget (the wait is at most
    ``min(max_wait_ms, timeout_ms)``); ``holder_name`` is a label for the admin, never
    used for decisions; ``in_progress``: the run already took a slot (allocation
    serves it first); ``key``: the fairness key (``None``: the shared keyless key).
    """

    request_id: str
    workload: str
    lineage: RunLineage
    timeout_ms: float | None = None
    holder_name: str | None = None
    in_progress: bool = False
    key: str | None = None

    def error(self, cls: type[E], message: str, *, limiter: str) -> E:
        """Build a ``ConcurrencyError`` subclass that names this request and its run."""
        return cls(
            message,
            limiter=limiter,
            workload=self.workload,
            run_id=self.lineage.run_id,
            root_run_id=self.lineage.root_run_id,
            parent_run_id=self.lineage.parent_run_id,
            request_id=self.request_id,
        )


@dataclass(frozen=True, slots=True)
class Lease:
    """A granted slot, valid for ``ttl_ms`` after the last grant or renewal.

    ``fencing_token`` increases with every lease the limiter grants (a provider proxy
    can reject stale holders). ``valid_until``: the latest moment (monotonic, here) the
    lease is surely valid, counted from when the request was *sent*; past it the hold
    is lost (``None``: counted from when the hold began). ``waited_ms``: the whole
    wait when the limiter knows better than the caller (a parked request's claim, from
    its first delivery); ``None``: the caller measures.
    """

    lease_id: str
    limiter: str
    workload: str
    request_id: str
    fencing_token: int
    ttl_ms: int
    valid_until: Deadline | None = None
    waited_ms: float | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class WorkloadStats:
    """Slots held and requests waiting for one workload."""

    active: int = 0
    queued: int = 0


@dataclass(frozen=True, slots=True)
class KeyStats:
    """Slots held and requests waiting for one key of a keyed limiter."""

    key: str
    active: int = 0
    queued: int = 0


@dataclass(frozen=True, slots=True)
class LimiterStats:
    """Slots held and requests waiting, in total and per workload (``keys``: a keyed
    limiter's keys in use, busiest first, when asked ``stats(per_key=True)``)."""

    active: int
    queued: int
    workloads: Mapping[str, WorkloadStats] = field(default_factory=dict)
    keys: Sequence[KeyStats] = ()


@dataclass(frozen=True, slots=True)
class QueuePlace:
    """Where a request that must wait joined the line: ``place`` counts from 1 in its
    workload's line (over several limiters the largest); ``expected_wait_ms`` from the
    limiter's figures (:class:`~runcell_celery.ports.WaitEstimate`), ``None``: unknown."""

    place: int
    expected_wait_ms: float | None = None


@runtime_checkable
class OnWaitWithPlace(Protocol):
    """An ``on_wait`` callback that can also be told the request's place in line,
    through :func:`announce_wait`, only when it wants it (a tracer records the wait):
    finding the place costs nothing otherwise. Plain :data:`OnWait` keeps working."""

    def __call__(self, deadline: float | None) -> None: ...

    def wants_place(self) -> bool: ...

    def placed(self, place: QueuePlace) -> None: ...


@runtime_checkable
class ConcurrencyLimiter(Protocol):
    """A source of slots shared by every run that uses it."""

    @property
    def name(self) -> str:
        """The limiter's name, used in events and errors."""
        ...

    def acquire(
        self,
        request: AcquireRequest,
        *,
        cancel: CancellationToken | None = None,
        on_wait: OnWait | None = None,
    ) -> Lease:
        """Wait for a slot and return its lease.

        :raises ConcurrencyTimeoutError, ConcurrencyQueueFullError: no slot in time, or
            ``max_queued`` requests already wait.
        :raises ConcurrencyCancelledError: ``cancel`` was set (a slot granted at that
            moment was returned).
        :raises ConcurrencyLimiterError: the limiter failed; no slot is held.
        """
        ...

    def renew(self, lease: Lease) -> Lease | None:
        """Extend the lease; ``None`` if the limiter no longer holds it (raises only
        for transient failures: the runtime retries until expiry)."""
        ...

    def release(self, lease: Lease, outcome: Outcome = "success") -> None:
        """Return the slot. Releasing twice, or an expired lease, does nothing."""
        ...


# -- optional abilities ----------------------------------------------------------------
#
# What a limiter may do beyond the protocol above. The runtime and the integration
# layers ask with ``isinstance(limiter, SupportsX)`` (or :func:`supports`, which caches
# the answer per class for the hot path), never by probing attributes.


@runtime_checkable
class SupportsStats(Protocol):
    """Reports slots held and requests waiting."""

    def stats(self) -> LimiterStats: ...


@runtime_checkable
class SupportsRenewMany(Protocol):
    """Renews several leases in one call (the keeper batches renewals per limiter)."""

    def renew_many(self, leases: Sequence[Lease]) -> Mapping[str, Lease | None]: ...


@runtime_checkable
class SupportsValidateWorkload(Protocol):
    """Resolves a workload name (``None``: the default) or raises
    :class:`~runcell_celery.errors.ConcurrencyConfigError` before anything waits."""

    def validate_workload(self, workload: str | None) -> str: ...


@runtime_checkable
class SupportsConfig(Protocol):
    """Built from a :class:`~runcell_celery.config.LimiterConfig` (limits, ``max_hold_ms``)."""

    @property
    def config(self) -> LimiterConfig: ...


@runtime_checkable
class SupportsReap(Protocol):
    """Runs one allocation pass on demand: reaps expired rows, grants what frees."""

    def reap(self) -> None: ...


@runtime_checkable
class SupportsKeys(Protocol):
    """A keyed limiter: ``key("acme")`` is the limiter of that key, named
    ``"<limiter>:<key>"``; the keyed limiter itself holds no slots."""

    def key(self, key: str) -> ConcurrencyLimiter: ...


@dataclass(frozen=True, slots=True)
class Member:
    """One part of an admission decision: a limiter and the request made of it (its
    workload, key, request id, run and budget there). Later kinds of member (rate
    buckets, token budgets) join the same decision."""

    limiter: ConcurrencyLimiter
    request: AcquireRequest


@runtime_checkable
class SupportsMembers(Protocol):
    """Grants one request over members of this backend, all or none, asked through
    the first member's limiter; leases in the members' order, each renewed and
    released by its own limiter. A member lacking room holds nothing in the others
    (:func:`~runcell_celery.allocation.allocate_members`). A limiter without it is a
    one-member backend (the runtime asks its ``acquire``). Raises as ``acquire``, and
    ``ConcurrencyConfigError`` for a member it cannot hold with the others."""

    def acquire_members(
        self,
        members: Sequence[Member],
        *,
        cancel: CancellationToken | None = None,
        on_wait: OnWait | None = None,
    ) -> tuple[Lease, ...]: ...


@runtime_checkable
class SupportsMembersAsync(Protocol):
    """:class:`SupportsMembers` without occupying a thread (``async with slot(...)``)."""

    async def acquire_members_async(
        self,
        members: Sequence[Member],
        *,
        cancel: CancellationToken | None = None,
        on_wait: OnWait | None = None,
    ) -> tuple[Lease, ...]: ...


@runtime_checkable
class SupportsReleaseExecutor(Protocol):
    """A limiter whose release does I/O: an ``async with`` exit releases on these
    threads, so it never blocks the event loop."""

    @property
    def release_executor(self) -> Executor: ...


_ability_cache: dict[tuple[type, type], bool] = {}


def supports(limiter: object, ability: type) -> bool:
    """``isinstance(limiter, ability)``, cached per class: a protocol check inspects
    every member on each call, and a class does not change its abilities."""
    key = (type(limiter), ability)
    found = _ability_cache.get(key)
    if found is None:
        found = _ability_cache[key] = isinstance(limiter, ability)
    return found


def announce_wait(
    on_wait: OnWait | None,
    deadline: float | None,
    place: Callable[[], QueuePlace | None] | None = None,
) -> None:
    """Tell ``on_wait`` that a request waits (``deadline``: Unix time); ``place``
    finds its :class:`QueuePlace`, called only when ``on_wait`` wants it."""
    if on_wait is None:
        return
    if place is not None and wants_place(on_wait):
        found = place()
        if found is not None:
            cast(OnWaitWithPlace, on_wait).placed(found)
    on_wait(deadline)


def wants_place(on_wait: OnWait | None) -> bool:
    """Whether ``on_wait`` is an :class:`OnWaitWithPlace` that wants the place now."""
    return (
        on_wait is not None
        and supports(on_wait, OnWaitWithPlace)
        and cast(OnWaitWithPlace, on_wait).wants_place()
    )


@runtime_checkable
class RunAdmission(Protocol):
    """What a run carries to admit its first slot before its body runs
    (:class:`~runcell_celery.admission.Admission`); the run only ends it."""

    def end(self, exc: BaseException | None) -> None: ...
