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

    :param request_id: unique per request; stable across retries of the same request
        so a limiter can recognise it (Celery deferral re-uses it).
    :param workload: the resolved workload name.
    :param lineage: the run the slot is for.
    :param timeout_ms: the run's remaining budget; the limiter waits at most
        ``min(workload max_wait_ms, timeout_ms)``. ``None``: no run budget.
    :param holder_name: a label for who holds the slot (e.g. the Celery task name);
        shown in the admin, never used for decisions.
    :param in_progress: the run already took a slot before (an agent's second call):
        allocation serves it before new runs of its workload (see
        :mod:`runcell_celery.allocation`).
    :param key: the request's fairness key (a tenant): a limiter with ``fairness:
        "round_robin"`` serves waiting requests of one workload round-robin by key.
        ``None``: the shared keyless key.
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
    """A granted slot. It stays valid for ``ttl_ms`` after the last grant or renewal.

    :param fencing_token: increases with every lease the limiter grants, so a provider
        proxy that remembers the highest token seen can reject a stale holder.
    :param valid_until: the latest moment (this process's monotonic clock) the lease is
        surely still valid, computed from when the request was *sent* (or the grant
        made) plus the TTL minus a safety margin. A hold that starts after it, or that
        misses its renewals past it, is treated as lost. ``None``: the limiter does not
        say (the keeper then counts the TTL from when the hold began).
    :param waited_ms: how long the request waited for this lease, when the limiter
        knows better than the caller: a parked request's claim answers its whole wait,
        from its first ask (its first delivery) to the claim, in database time, where
        the claiming delivery saw only the claim. ``None``: the caller measures.
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
    """Slots held and requests waiting, in total and per workload.

    :param keys: for a keyed limiter asked ``stats(per_key=True)``: the keys in use,
        busiest first; empty otherwise.
    """

    active: int
    queued: int
    workloads: Mapping[str, WorkloadStats] = field(default_factory=dict)
    keys: Sequence[KeyStats] = ()


@dataclass(frozen=True, slots=True)
class QueuePlace:
    """Where a request that must wait joined the line, as its limiter saw it then.

    :param place: its place in its workload's line, counting from 1 (the requests of
        its workload in line before it, plus one). Over several limiters, the largest
        of its places: it is granted when every line has let it through.
    :param expected_wait_ms: how long it is likely to wait, from the limiter's own
        figures (see :class:`~runcell_celery.ports.WaitEstimate`); ``None`` when the
        limiter cannot tell.
    """

    place: int
    expected_wait_ms: float | None = None


@runtime_checkable
class OnWaitWithPlace(Protocol):
    """An ``on_wait`` callback that can also be told the request's place in line.

    A plain :data:`OnWait` (a function of the deadline) keeps working with every
    limiter, and a limiter that only calls ``on_wait(deadline)`` keeps working with
    this one: the place is an addition, told through :func:`announce_wait` only to a
    callback that has these methods and wants it now (the slot runtime wants it while a
    tracer records the wait span), so finding the place costs nothing otherwise.
    """

    def __call__(self, deadline: float | None) -> None:
        """The request waits (``deadline``: Unix time, ``None``: none)."""
        ...

    def wants_place(self) -> bool:
        """Whether the place is worth finding for this wait."""
        ...

    def placed(self, place: QueuePlace) -> None:
        """Where the request joined the line (told before the call with the deadline)."""
        ...


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

        :raises ConcurrencyTimeoutError: no slot before the deadline.
        :raises ConcurrencyQueueFullError: ``max_queued`` requests already wait.
        :raises ConcurrencyCancelledError: ``cancel`` was set; a slot granted at the
            same moment has been returned.
        :raises ConcurrencyLimiterError: the limiter failed; no slot is held.
        """
        ...

    def renew(self, lease: Lease) -> Lease | None:
        """Extend the lease; ``None`` if the limiter no longer holds it.

        Raises only for transient failures (the runtime retries until expiry).
        """
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
    """A keyed limiter (``keyed=True``): a limit per key, each key a limiter of its own.

    ``key("acme")`` returns the limiter of that key (:mod:`runcell_celery.keys` checks
    the key and names it ``"<limiter>:<key>"``); the keyed limiter itself holds no slots,
    so a slot names one of its keys, never the keyed limiter.
    """

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
    """Grants one request over several members of this backend, all or none.

    Asked through the first member's limiter; leases come in the members' order and are
    renewed and released one by one by their own limiter. A member that lacks room
    holds nothing in the others (:func:`runcell_celery.allocation.allocate_members`).
    A limiter without it is a one-member backend: the runtime asks its ``acquire``.

    :raises ConcurrencyConfigError: a member this backend cannot hold with the others.
    :raises ConcurrencyTimeoutError, ConcurrencyQueueFullError,
        ConcurrencyCancelledError, ConcurrencyLimiterError: as
        :meth:`ConcurrencyLimiter.acquire`; no slot is held.
    """

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
    """``isinstance(limiter, ability)`` for a runtime-checkable ability, cached per class.

    ``isinstance`` against a protocol inspects every member on each call; a limiter's
    class does not change its abilities, so the answer is remembered.
    """
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
    """Tell ``on_wait`` that a request waits: for a limiter to call once it queued one.

    :param deadline: the wait's deadline, Unix time (``None``: no deadline).
    :param place: finds the request's :class:`QueuePlace` (``None`` inside: unknown).
        Called only when ``on_wait`` is an :class:`OnWaitWithPlace` that wants it, so a
        limiter may count its line there; a plain callback gets the deadline alone.
    """
    if on_wait is None:
        return
    if place is not None and wants_place(on_wait):
        found = place()
        if found is not None:
            cast(OnWaitWithPlace, on_wait).placed(found)
    on_wait(deadline)


def wants_place(on_wait: OnWait | None) -> bool:
    """Whether ``on_wait`` is an :class:`OnWaitWithPlace` that wants the place now: for a
    limiter that must ask for more to learn it (it is asked again at the wait)."""
    return (
        on_wait is not None
        and supports(on_wait, OnWaitWithPlace)
        and cast(OnWaitWithPlace, on_wait).wants_place()
    )


@runtime_checkable
class RunAdmission(Protocol):
    """What a run carries to admit its first slot before its body runs, as the run sees
    it (:class:`~runcell_celery.admission.Admission` is the one implementation): the
    run only hands it to its child runs and ends it."""

    def end(self, exc: BaseException | None) -> None:
        """The run ended (``exc``: what its body raised)."""
