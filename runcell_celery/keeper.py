"""The lease keeper: one thread per backend and process renews every held slot and
watches deadlines.

A thread per lease would cost a thread per provider call; instead every held slot is
registered here and one named loop (``runcell-lease-keeper``, a
:class:`~runcell_celery.background.BackgroundLoop`) wakes when the next renewal or
deadline is due. Renewals of the leases one limiter holds are batched into one
``renew_many`` call when the limiter declares
:class:`~runcell_celery.protocol.SupportsRenewMany` (one SQL statement for PostgreSQL).

The keeper decides nothing about a hold's outcome itself: it tells the
:class:`LeaseHolder` what happened (renewed, renewal failed, lost, deadline passed)
and the holder reacts. It also tells the holder until when its lease is valid here
(:func:`local_validity`, on the keeper's :attr:`LeaseKeeper.clock`): the holder reads
that same bound when its body ends or asks whether it was aborted, so a lease whose
validity passed is lost whichever thread looks first. It keeps only weak references,
so a hold that is dropped without being exited simply stops being renewed and its
lease expires. It logs instead of dying.

Who owns it: a backend that has resources of its own gives its limiters its keeper
(``limiter.keeper``: the PostgreSQL backend's engine, closed with the backend, made
anew in a forked child); a limiter that brings none (in memory, or one written by a
user) is kept by this process's shared keeper (:func:`get_keeper`).
"""

from __future__ import annotations

import logging
import math
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, TypeVar, cast, runtime_checkable

from .background import DEFAULT_REGISTRY, BackgroundLoop
from .clock import SYSTEM_CLOCK, Clock
from .deadline import Deadline
from .protocol import ConcurrencyLimiter, Lease, SupportsRenewMany, supports

__all__ = ["LeaseHolder", "LeaseKeeper", "get_keeper", "local_validity"]

logger = logging.getLogger("runcell_celery.keeper")

T = TypeVar("T")

#: Renew when a third of the TTL has passed, so two renewals can fail before expiry.
RENEW_FRACTION = 1 / 3
#: After a failed renewal, try again this often (capped by the TTL's fraction).
RETRY_SECONDS = 1.0
#: The longest the keeper sleeps, so a stopped or dropped keeper lets its thread end.
MAX_SLEEP_SECONDS = 60.0
#: With nothing to keep, the keeper looks again this often. A new hold wakes it only
#: when due sooner (a short max_hold); a slot held and released within this tick
#: costs the keeper nothing, where waking it for every hold would cost a thread
#: switch per provider call.
IDLE_TICK_SECONDS = 1.0


@runtime_checkable
class SupportsLossReason(Protocol):
    """A limiter that can say why it no longer holds a lease (an operator took it back)."""

    def loss_reason(self, lease: Lease) -> str | None:
        """``"force-released by alice"``, or ``None`` when it does not know."""
        ...


class LeaseTakenBackError(Exception):
    """Why a lease was lost, when the limiter knows (``force-released by alice``).

    The keeper hands it to :meth:`LeaseHolder.lease_lost` as the error, so a holder
    that reads no reason still works.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def local_validity(lease: Lease, now: float) -> Deadline:
    """Until when ``lease`` is surely valid in this process, as the keeper counts it.

    The limiter's own bound (:attr:`Lease.valid_until`, counted from when the request
    was sent) when it gives one, else a TTL from ``now`` (when the hold began, or when
    the renewal that returned ``lease`` was sent). Past it without a successful
    renewal, the lease is lost: another holder may have the slot.
    """
    if lease.valid_until is not None:
        return lease.valid_until
    return Deadline(now + lease.ttl_ms / 1000)


class LeaseHolder(Protocol):
    """What the keeper needs from whoever holds a lease (:class:`~.hold.Hold`)."""

    def kept_lease(self) -> tuple[ConcurrencyLimiter, Lease] | None:
        """The limiter and lease to renew, or ``None`` once the hold has ended."""
        ...

    def lease_renewed(self, lease: Lease, valid_until: Deadline) -> None:
        """The lease was renewed: ``lease`` is valid here until ``valid_until``."""
        ...

    def renewal_failed(self, error: BaseException) -> None: ...

    def lease_lost(self, error: BaseException | None) -> None: ...

    def deadline_passed(self) -> Deadline | None:
        """The deadline given to :meth:`LeaseKeeper.keep` passed; return a later
        deadline to watch as well, or ``None``."""
        ...


class _Entry:
    __slots__ = ("deadline", "expires_at", "holder", "renew_at", "ttl")

    def __init__(
        self,
        holder: LeaseHolder,
        ttl: float,
        now: float,
        deadline: Deadline | None,
        valid_until: Deadline | None,
    ) -> None:
        self.holder = weakref.ref(holder)
        self.ttl = ttl
        self.renew_at = now + ttl * RENEW_FRACTION
        # Where the keeper must assume the lease is gone if no renewal succeeded
        # (what local_validity says; the holder reads the same bound).
        self.expires_at = now + ttl if valid_until is None else valid_until.at
        self.deadline = math.inf if deadline is None else deadline.at

    def next_due(self) -> float:
        return min(self.renew_at, self.expires_at, self.deadline)


class LeaseKeeper:
    """Renews held leases and fires hold deadlines from one background loop.

    All times inside are instants of :attr:`clock`'s ``monotonic()`` (what a
    :class:`~runcell_celery.deadline.Deadline` holds: ``time.monotonic()``, unless a
    test gives a clock of its own).
    """

    def __init__(self, clock: Clock = SYSTEM_CLOCK) -> None:
        #: The clock of every instant the keeper compares, and of its holders' leases'
        #: local validity.
        self.clock = clock
        self._cond = threading.Condition(threading.Lock())
        self._entries: dict[int, _Entry] = {}
        self._next_key = 0
        self._wake_at = math.inf
        self._loop = BackgroundLoop("runcell-lease-keeper", self, LeaseKeeper._step)
        self._started = False

    def keep(
        self,
        holder: LeaseHolder,
        ttl_ms: int,
        deadline: Deadline | None,
        valid_until: Deadline | None = None,
    ) -> int:
        """Start renewing ``holder``'s lease; fire its deadline if given.

        :param valid_until: the lease's local validity (:func:`local_validity`): past
            it without a successful renewal, the lease is lost. ``None``: a TTL from now.
        :returns: a key for :meth:`forget`.
        """
        entry = _Entry(holder, ttl_ms / 1000, self.clock.monotonic(), deadline, valid_until)
        with self._cond:
            key = self._next_key
            self._next_key += 1
            self._entries[key] = entry
            if not self._started:
                self._started = True
                self._loop.start()
            elif entry.next_due() < self._wake_at:
                self._cond.notify()
        return key

    def forget(self, key: int) -> None:
        """Stop renewing (the hold released its slot)."""
        with self._cond:
            self._entries.pop(key, None)

    def held(self) -> int:
        """How many holds are registered (for tests and stats)."""
        with self._cond:
            return len(self._entries)

    def stop(self, timeout: float | None = None) -> None:
        """End the keeper's loop (its leases are then left to expire)."""
        self._loop.stop()
        with self._cond:
            self._cond.notify()
        self._loop.stop(timeout)

    def _step(self) -> float:
        # The step blocks on the condition until something is due: no pause after it.
        self.service()
        return 0.0

    def _wait_for_due(self) -> list[tuple[int, _Entry]]:
        with self._cond:
            while True:
                now = self.clock.monotonic()
                if self._loop.stopping.is_set():
                    return []
                due_at = min(
                    (e.next_due() for e in self._entries.values()),
                    default=now + IDLE_TICK_SECONDS,
                )
                if due_at <= now:
                    self._wake_at = math.inf
                    return list(self._entries.items())
                self._wake_at = min(due_at, now + MAX_SLEEP_SECONDS)
                self._cond.wait(self._wake_at - now)
                if not self._entries:
                    return []  # let the loop see whether its owner is still there

    def service(self) -> None:
        """Do everything that is due now: deadlines, renewals, expiry."""
        entries = self._wait_for_due()
        now = self.clock.monotonic()
        candidates: dict[int, list[tuple[int, _Entry, Lease]]] = {}
        limiters: dict[int, ConcurrencyLimiter] = {}
        due: set[int] = set()
        for key, entry in entries:
            holder = entry.holder()
            kept = holder.kept_lease() if holder is not None else None
            if holder is None or kept is None:
                self.forget(key)
                continue
            if entry.deadline <= now:
                later = _safely(holder.deadline_passed)
                entry.deadline = math.inf if later is None else later.at
                if holder.kept_lease() is None:
                    self.forget(key)
                    continue
            if entry.expires_at <= now:
                self.forget(key)
                _safely(holder.lease_lost, None)
                continue
            # When one lease of a limiter is due, renew with it every lease of that
            # limiter due within the next period: from then on they stay in step, and
            # each limiter costs one renew_many call (one SQL statement) per period.
            if entry.renew_at <= now + entry.ttl * RENEW_FRACTION:
                limiter, lease = kept
                limiters[id(limiter)] = limiter
                candidates.setdefault(id(limiter), []).append((key, entry, lease))
                if entry.renew_at <= now:
                    due.add(id(limiter))
        for limiter_id in due:
            self._renew_batch(limiters[limiter_id], candidates[limiter_id])

    def _renew_batch(
        self, limiter: ConcurrencyLimiter, batch: Sequence[tuple[int, _Entry, Lease]]
    ) -> None:
        sent_at = self.clock.monotonic()
        leases = [lease for _, _, lease in batch]
        try:
            results = _renew(limiter, leases)
        except Exception as exc:
            for _, entry, _lease in batch:
                entry.renew_at = sent_at + min(RETRY_SECONDS, entry.ttl * RENEW_FRACTION / 2)
                holder = entry.holder()
                if holder is not None:
                    _safely(holder.renewal_failed, exc)
            return
        for key, entry, lease in batch:
            holder = entry.holder()
            renewed = results.get(lease.lease_id)
            if holder is None:
                self.forget(key)
            elif renewed is None:
                self.forget(key)
                _safely(holder.lease_lost, _why_lost(limiter, lease))
            else:
                entry.renew_at = sent_at + entry.ttl * RENEW_FRACTION
                bound = local_validity(renewed, sent_at)
                entry.expires_at = bound.at
                _safely(holder.lease_renewed, renewed, bound)


def _renew(limiter: ConcurrencyLimiter, leases: Sequence[Lease]) -> Mapping[str, Lease | None]:
    if len(leases) > 1 and supports(limiter, SupportsRenewMany):
        return cast(SupportsRenewMany, limiter).renew_many(leases)
    return {lease.lease_id: limiter.renew(lease) for lease in leases}


def _why_lost(limiter: ConcurrencyLimiter, lease: Lease) -> LeaseTakenBackError | None:
    """Ask the limiter why it no longer holds ``lease`` (one read, only when a lease is
    lost); ``None`` when it cannot say."""
    if not supports(limiter, SupportsLossReason):
        return None
    try:
        reason = cast(SupportsLossReason, limiter).loss_reason(lease)
    except Exception as exc:  # the loss stands; only its reason is unknown
        logger.info("runcell lease keeper: why %s was lost is unknown: %s", lease.lease_id, exc)
        return None
    return LeaseTakenBackError(reason) if reason else None


def _safely(call: Callable[..., T], *args: object) -> T | None:
    try:
        return call(*args)
    except Exception:
        logger.exception("runcell lease keeper: a hold callback failed")
        return None


def get_keeper(limiter: object = None) -> LeaseKeeper:
    """The keeper of ``limiter``'s leases: its backend's (``limiter.keeper``), else this
    process's shared one, made on first use."""
    keeper = getattr(limiter, "keeper", None)
    if isinstance(keeper, LeaseKeeper):
        return keeper
    # A forked child makes its own: the parent's thread does not exist there.
    return DEFAULT_REGISTRY.local("keeper.fallback", LeaseKeeper)
