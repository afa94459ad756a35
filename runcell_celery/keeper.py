"""The lease keeper: one loop per backend and process renews every held slot and
fires hold deadlines (a thread per lease would cost a thread per provider call).

Leases of one limiter are renewed in one ``renew_many`` call where the limiter
supports it. The keeper decides no outcome: it tells the :class:`LeaseHolder` what
happened, and both read the same :func:`local_validity` bound, so a lease whose
validity passed is lost whichever thread looks first. Holders are held weakly: a
dropped hold stops being renewed and its lease expires.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import weakref
from collections.abc import Callable, Sequence
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
#: With nothing to keep, the keeper looks again this often; a new hold wakes it only
#: when due sooner, so a short hold costs no thread switch.
IDLE_TICK_SECONDS = 1.0


@runtime_checkable
class SupportsLossReason(Protocol):
    """A limiter that can say why it no longer holds a lease (an operator took it back)."""

    def loss_reason(self, lease: Lease) -> str | None:
        """``"force-released by alice"``, or ``None`` when it does not know."""
        ...


class LeaseTakenBackError(Exception):
    """Why a lease was lost, when the limiter knows (``force-released by alice``)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def local_validity(lease: Lease, now: float) -> Deadline:
    """Until when ``lease`` is surely valid here: the limiter's :attr:`Lease.valid_until`,
    else a TTL from ``now`` (when the hold began or its renewal was sent). Past it
    without a renewal the lease is lost: another holder may have the slot."""
    if lease.valid_until is not None:
        return lease.valid_until
    return Deadline(now + lease.ttl_ms / 1000)


class LeaseHolder(Protocol):
    """What the keeper needs from whoever holds leases (:class:`~.hold.Hold`); ``index``
    says which of them: each lease is kept on its own, so renewals batch per limiter."""

    def kept_lease(self, index: int) -> tuple[ConcurrencyLimiter, Lease] | None:
        """The limiter and lease to renew, or ``None`` once the hold has ended."""

    def lease_renewed(self, index: int, lease: Lease, valid_until: Deadline) -> None: ...

    def renewal_failed(self, index: int, error: BaseException) -> None: ...

    def lease_lost(self, index: int, error: BaseException | None) -> None: ...

    def deadline_passed(self) -> Deadline | None:
        """The deadline given to :meth:`LeaseKeeper.keep` passed; a later one to watch,
        or ``None``."""


class _Entry:
    __slots__ = ("deadline", "expires_at", "holder", "index", "renew_at", "ttl")

    def __init__(
        self,
        holder: LeaseHolder,
        index: int,
        ttl: float,
        now: float,
        deadline: Deadline | None,
        valid_until: Deadline | None,
    ) -> None:
        self.holder = weakref.ref(holder)
        self.index = index
        self.ttl = ttl
        self.renew_at = now + ttl * RENEW_FRACTION
        # Lost past this without a renewal (local_validity; the holder reads the same).
        self.expires_at = now + ttl if valid_until is None else valid_until.at
        self.deadline = math.inf if deadline is None else deadline.at

    def next_due(self) -> float:
        return min(self.renew_at, self.expires_at, self.deadline)


class LeaseKeeper:
    """Renews held leases and fires hold deadlines from one background loop; every
    instant inside is :attr:`clock`'s ``monotonic()``."""

    def __init__(self, clock: Clock = SYSTEM_CLOCK) -> None:
        self.clock = clock
        self._cond = threading.Condition(threading.Lock())
        self._entries: dict[int, _Entry] = {}
        self._keys = itertools.count()
        self._wake_at = math.inf
        self._loop = BackgroundLoop("runcell-lease-keeper", self, LeaseKeeper.service)
        self._started = False

    def keep(
        self,
        holder: LeaseHolder,
        index: int,
        ttl_ms: int,
        deadline: Deadline | None,
        valid_until: Deadline | None = None,
    ) -> int:
        """Renew ``holder``'s lease ``index`` (lost past ``valid_until``, default a TTL
        from now) and fire ``deadline``; return a key for :meth:`forget`."""
        entry = _Entry(holder, index, ttl_ms / 1000, self.clock.monotonic(), deadline, valid_until)
        with self._cond:
            self._entries[key := next(self._keys)] = entry
            if not self._started:
                self._started = True
                self._loop.start()
            elif entry.next_due() < self._wake_at:
                self._cond.notify()
        return key

    def forget(self, key: int) -> None:
        with self._cond:
            self._entries.pop(key, None)

    def held(self) -> int:
        with self._cond:
            return len(self._entries)

    def stop(self, timeout: float | None = None) -> None:
        """End the keeper's loop (its leases are left to expire)."""
        self._loop.stop()
        with self._cond:
            self._cond.notify()
        self._loop.stop(timeout)

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

    def service(self) -> float:
        """Do everything that is due now: deadlines, renewals, expiry; as the loop's step
        it returns no pause, blocking on the condition until something is due."""
        entries = self._wait_for_due()
        now = self.clock.monotonic()
        batches: dict[int, tuple[ConcurrencyLimiter, list[tuple[int, _Entry, Lease]]]] = {}
        due: set[int] = set()
        for key, entry in entries:
            holder = entry.holder()
            kept = holder.kept_lease(entry.index) if holder is not None else None
            if holder is None or kept is None:
                self.forget(key)
                continue
            if entry.deadline <= now:
                later = _safely(holder.deadline_passed)
                entry.deadline = math.inf if later is None else later.at
                if holder.kept_lease(entry.index) is None:
                    self.forget(key)
                    continue
            if entry.expires_at <= now:
                self.forget(key)
                _safely(holder.lease_lost, entry.index, None)
                continue
            # Renew with a due lease every lease of its limiter due within a period: they
            # stay in step, one renew_many call per limiter and period.
            if entry.renew_at <= now + entry.ttl * RENEW_FRACTION:
                limiter, lease = kept
                batches.setdefault(id(limiter), (limiter, []))[1].append((key, entry, lease))
                if entry.renew_at <= now:
                    due.add(id(limiter))
        for limiter_id in due:
            self._renew_batch(*batches[limiter_id])
        return 0.0

    def _renew_batch(
        self, limiter: ConcurrencyLimiter, batch: Sequence[tuple[int, _Entry, Lease]]
    ) -> None:
        sent_at = self.clock.monotonic()
        leases = [lease for _, _, lease in batch]
        try:
            if len(leases) > 1 and supports(limiter, SupportsRenewMany):
                results = cast(SupportsRenewMany, limiter).renew_many(leases)
            else:
                results = {lease.lease_id: limiter.renew(lease) for lease in leases}
        except Exception as exc:
            for _, entry, _lease in batch:
                entry.renew_at = sent_at + min(RETRY_SECONDS, entry.ttl * RENEW_FRACTION / 2)
                holder = entry.holder()
                if holder is not None:
                    _safely(holder.renewal_failed, entry.index, exc)
            return
        for key, entry, lease in batch:
            holder = entry.holder()
            renewed = results.get(lease.lease_id)
            if holder is None:
                self.forget(key)
            elif renewed is None:
                self.forget(key)
                _safely(holder.lease_lost, entry.index, _why_lost(limiter, lease))
            else:
                entry.renew_at = sent_at + entry.ttl * RENEW_FRACTION
                bound = local_validity(renewed, sent_at)
                entry.expires_at = bound.at
                _safely(holder.lease_renewed, entry.index, renewed, bound)


def _why_lost(limiter: ConcurrencyLimiter, lease: Lease) -> LeaseTakenBackError | None:
    """Ask the limiter why it no longer holds ``lease``; ``None`` when it cannot say."""
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
    """``limiter.keeper`` (its backend's), else this process's shared keeper."""
    keeper = getattr(limiter, "keeper", None)
    if isinstance(keeper, LeaseKeeper):
        return keeper
    # A forked child makes its own: the parent's thread does not exist there.
    return DEFAULT_REGISTRY.local("keeper.fallback", LeaseKeeper)
