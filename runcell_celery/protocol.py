"""What a limiter is: the :class:`ConcurrencyLimiter` protocol and the values it trades.

The slot runtime owns the lifecycle (deadlines, renewal, release, events); a limiter
owns allocation, queue order and storage. Further abilities are the runtime-checkable
``Supports*`` protocols, asked with :func:`supports`, never by probing attributes.
:func:`runcell_celery.conformance.concurrency_conformance_cases` checks a custom one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol, TypeVar, cast, runtime_checkable

from .background import DEFAULT_REGISTRY
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
    "acquire_members",
    "announce_wait",
    "supports",
    "wants_place",
]

#: How a hold ended, passed to :meth:`ConcurrencyLimiter.release` and in ``released``.
Outcome = Literal["success", "error", "cancelled", "timed-out", "max-hold", "lease-lost"]

#: Called by a limiter when a request must wait, with the wait's deadline (Unix time).
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
    """One request for one slot. ``timeout_ms``: the run's remaining budget;
    ``in_progress``: the run already took a slot (allocation serves it first)."""

    request_id: str
    workload: str
    lineage: RunLineage
    timeout_ms: float | None = None
    holder_name: str | None = None
    in_progress: bool = False
    key: str | None = None

    def error(self, cls: type[E], message: str, *, limiter: str) -> E:
        lineage = asdict(self.lineage)
        return cls(
            message, limiter=limiter, workload=self.workload, request_id=self.request_id, **lineage
        )


@dataclass(frozen=True, slots=True)
class Lease:
    """A granted slot, valid for ``ttl_ms`` after the last grant or renewal.
    ``valid_until``: surely valid until then (counted from when the request was *sent*);
    ``waited_ms``: the whole wait when the limiter knows better (a parked claim)."""

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
    """Slots held and requests waiting (``keys``: busiest first, ``per_key=True``)."""

    active: int
    queued: int
    workloads: Mapping[str, WorkloadStats] = field(default_factory=dict)
    keys: Sequence[KeyStats] = ()


@dataclass(frozen=True, slots=True)
class QueuePlace:
    """Where a waiting request joined the line (from 1; over several limiters the largest)."""

    place: int
    expected_wait_ms: float | None = None


@runtime_checkable
class OnWaitWithPlace(Protocol):
    """An ``on_wait`` told the place in line only when it wants it (finding it may mean
    counting a line)."""

    def __call__(self, deadline: float | None) -> None: ...

    def wants_place(self) -> bool: ...

    def placed(self, place: QueuePlace) -> None: ...


@runtime_checkable
class ConcurrencyLimiter(Protocol):
    """A source of slots shared by every run that uses it."""

    @property
    def name(self) -> str: ...

    def acquire(
        self,
        request: AcquireRequest,
        *,
        cancel: CancellationToken | None = None,
        on_wait: OnWait | None = None,
    ) -> Lease:
        """Wait for a slot. Raises ``ConcurrencyTimeoutError``, ``...QueueFullError``,
        ``...CancelledError`` (a slot granted at that moment is returned) or
        ``...LimiterError``; none leaves a slot held."""
        ...

    def renew(self, lease: Lease) -> Lease | None:
        """``None`` if the limiter no longer holds it (raises only for transient failures)."""
        ...

    def release(self, lease: Lease, outcome: Outcome = "success") -> None: ...


@runtime_checkable
class SupportsStats(Protocol):
    def stats(self) -> LimiterStats: ...


@runtime_checkable
class SupportsRenewMany(Protocol):
    """Renews several leases in one call (the keeper batches renewals per limiter)."""

    def renew_many(self, leases: Sequence[Lease]) -> Mapping[str, Lease | None]: ...


@runtime_checkable
class SupportsValidateWorkload(Protocol):
    """Resolves a workload name (``None``: the default) or raises, before anything waits."""

    def validate_workload(self, workload: str | None) -> str: ...


@runtime_checkable
class SupportsConfig(Protocol):
    @property
    def config(self) -> LimiterConfig: ...


@runtime_checkable
class SupportsReap(Protocol):
    def reap(self) -> None: ...


@runtime_checkable
class SupportsKeys(Protocol):
    """A keyed limiter: ``key("acme")`` is the limiter ``"<limiter>:acme"``."""

    def key(self, key: str) -> ConcurrencyLimiter: ...


@dataclass(frozen=True, slots=True)
class Member:
    """One part of an admission decision: a limiter and the request made of it (later
    kinds of member, such as rate buckets, join the same decision)."""

    limiter: ConcurrencyLimiter
    request: AcquireRequest


@runtime_checkable
class SupportsMembers(Protocol):
    """Grants one request over members of this backend, all or none, asked through the
    first member's limiter; leases in the members' order. Without it a limiter is a
    one-member backend. Raises as ``acquire``, or ``ConcurrencyConfigError``."""

    def acquire_members(
        self,
        members: Sequence[Member],
        *,
        cancel: CancellationToken | None = None,
        on_wait: OnWait | None = None,
    ) -> tuple[Lease, ...]: ...


def acquire_members(
    members: Sequence[Member],
    *,
    cancel: CancellationToken | None = None,
    on_wait: OnWait | None = None,
) -> tuple[Lease, ...]:
    """Grant one request over ``members`` through the first member's limiter: its
    ``acquire_members``, or ``acquire`` for a one-member backend (one member only)."""
    first = members[0].limiter
    if supports(first, SupportsMembers):
        granted = cast(SupportsMembers, first).acquire_members
        return tuple(granted(members, cancel=cancel, on_wait=on_wait))
    return (first.acquire(members[0].request, cancel=cancel, on_wait=on_wait),)


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
    """A release doing I/O: an ``async with`` exit releases on these threads."""

    @property
    def release_executor(self) -> Executor: ...


def supports(limiter: object, ability: type) -> bool:
    """``isinstance(limiter, ability)``, cached per class (a protocol check is slow)."""
    key = (type(limiter), ability)
    cache: dict[tuple[type, type], bool] = DEFAULT_REGISTRY.shared("protocol.abilities", dict)
    found = cache.get(key)
    if found is None:
        found = cache[key] = isinstance(limiter, ability)
    return found


def announce_wait(
    on_wait: OnWait | None,
    deadline: float | None,
    place: Callable[[], QueuePlace | None] | None = None,
) -> None:
    if on_wait is None:
        return
    if place is not None and wants_place(on_wait):
        found = place()
        if found is not None:
            cast(OnWaitWithPlace, on_wait).placed(found)
    on_wait(deadline)


def wants_place(on_wait: OnWait | None) -> bool:
    return (
        on_wait is not None
        and supports(on_wait, OnWaitWithPlace)
        and cast(OnWaitWithPlace, on_wait).wants_place()
    )


@runtime_checkable
class RunAdmission(Protocol):
    def end(self, exc: BaseException | None) -> None: ...
