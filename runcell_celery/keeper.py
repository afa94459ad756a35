"""The lease keeper: one thread per process renews every held slot and watches deadlines.

A thread per lease would cost a thread per provider call; instead every held slot is
registered here and one named thread (``runcell-lease-keeper``) wakes when the next
renewal or deadline is due. Renewals of the leases one limiter holds are batched into
one ``renew_many`` call when the limiter has it (one SQL statement for PostgreSQL).

The keeper decides nothing about a hold's outcome itself: it tells the hold what
happened (renewed, renewal failed, lost, deadline passed) and the hold reacts. It
keeps only weak references, so a hold that is dropped without being exited simply
stops being renewed and its lease expires. It logs instead of dying, and a forked
child (Celery prefork) starts with a keeper of its own.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, TypeVar

from .protocol import ConcurrencyLimiter, Lease

__all__ = ["Hold", "LeaseKeeper", "get_keeper"]

logger = logging.getLogger("runcell_celery.keeper")

T = TypeVar("T")

#: Renew when a third of the TTL has passed, so two renewals can fail before expiry.
RENEW_FRACTION = 1 / 3
#: After a failed renewal, try again this often (capped by the TTL's fraction).
RETRY_SECONDS = 1.0


class Hold(Protocol):
    """What the keeper needs from a held slot (implemented by :class:`~.slot.Slot`)."""

    def kept_lease(self) -> tuple[ConcurrencyLimiter, Lease] | None:
        """The limiter and lease to renew, or ``None`` once the hold has ended."""
        ...

    def lease_renewed(self, lease: Lease) -> None: ...

    def renewal_failed(self, error: BaseException) -> None: ...

    def lease_lost(self, error: BaseException | None) -> None: ...

    def deadline_passed(self) -> float | None:
        """The deadline given to :meth:`LeaseKeeper.keep` passed; return a later
        deadline (monotonic) to watch as well, or ``None``."""
        ...


class _Entry:
    __slots__ = ("deadline", "expires_at", "hold", "renew_at", "ttl")

    def __init__(self, hold: Hold, ttl: float, now: float, deadline: float | None) -> None:
        self.hold = weakref.ref(hold)
        self.ttl = ttl
        self.renew_at = now + ttl * RENEW_FRACTION
        # Where the keeper must assume the lease is gone if no renewal succeeded.
        self.expires_at = now + ttl
        self.deadline = math.inf if deadline is None else deadline

    def next_due(self) -> float:
        return min(self.renew_at, self.expires_at, self.deadline)


class LeaseKeeper:
    """Renews held leases and fires hold deadlines from one background thread."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._entries: dict[int, _Entry] = {}
        self._next_key = 0
        self._wake_at = math.inf
        self._thread: threading.Thread | None = None

    def keep(self, hold: Hold, ttl_ms: int, deadline: float | None) -> int:
        """Start renewing ``hold``'s lease; fire its deadline (monotonic) if given.

        :returns: a key for :meth:`forget`.
        """
        now = time.monotonic()
        entry = _Entry(hold, ttl_ms / 1000, now, deadline)
        with self._cond:
            key = self._next_key
            self._next_key += 1
            self._entries[key] = entry
            if self._thread is None:
                self._start_locked()
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

    def _start_locked(self) -> None:
        self._thread = threading.Thread(
            target=_run_keeper, args=(weakref.ref(self),), name="runcell-lease-keeper", daemon=True
        )
        self._thread.start()

    def _wait_for_due(self) -> list[tuple[int, _Entry]]:
        with self._cond:
            while True:
                now = time.monotonic()
                due_at = min((e.next_due() for e in self._entries.values()), default=math.inf)
                if due_at <= now:
                    self._wake_at = math.inf
                    return list(self._entries.items())
                self._wake_at = due_at
                # Wake at least every minute so a collected keeper lets its thread end.
                self._cond.wait(min(due_at - now, 60.0))
                if not self._entries:
                    return []

    def service(self) -> None:
        """Do everything that is due now: deadlines, renewals, expiry."""
        entries = self._wait_for_due()
        now = time.monotonic()
        candidates: dict[int, list[tuple[int, _Entry, Lease]]] = {}
        limiters: dict[int, ConcurrencyLimiter] = {}
        due: set[int] = set()
        for key, entry in entries:
            hold = entry.hold()
            kept = hold.kept_lease() if hold is not None else None
            if hold is None or kept is None:
                self.forget(key)
                continue
            if entry.deadline <= now:
                later = _safely(hold.deadline_passed)
                entry.deadline = math.inf if later is None else later
                if hold.kept_lease() is None:
                    self.forget(key)
                    continue
            if entry.expires_at <= now:
                self.forget(key)
                _safely(hold.lease_lost, None)
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
        sent_at = time.monotonic()
        leases = [lease for _, _, lease in batch]
        try:
            results = _renew(limiter, leases)
        except Exception as exc:
            for _, entry, _lease in batch:
                entry.renew_at = sent_at + min(RETRY_SECONDS, entry.ttl * RENEW_FRACTION / 2)
                hold = entry.hold()
                if hold is not None:
                    _safely(hold.renewal_failed, exc)
            return
        for key, entry, lease in batch:
            hold = entry.hold()
            renewed = results.get(lease.lease_id)
            if hold is None:
                self.forget(key)
            elif renewed is None:
                self.forget(key)
                _safely(hold.lease_lost, None)
            else:
                entry.renew_at = sent_at + entry.ttl * RENEW_FRACTION
                entry.expires_at = sent_at + entry.ttl
                _safely(hold.lease_renewed, renewed)


def _renew(limiter: ConcurrencyLimiter, leases: Sequence[Lease]) -> Mapping[str, Lease | None]:
    renew_many = getattr(limiter, "renew_many", None)
    if renew_many is not None and len(leases) > 1:
        result: Mapping[str, Lease | None] = renew_many(leases)
        return result
    return {lease.lease_id: limiter.renew(lease) for lease in leases}


def _safely(call: Callable[..., T], *args: object) -> T | None:
    try:
        return call(*args)
    except Exception:
        logger.exception("runcell lease keeper: a hold callback failed")
        return None


def _run_keeper(keeper_ref: weakref.ref[LeaseKeeper]) -> None:
    while True:
        keeper = keeper_ref()
        if keeper is None:
            return
        try:
            keeper.service()
        except Exception:  # never die: a dead keeper would let every lease expire
            logger.exception("runcell lease keeper failed; continuing")
            time.sleep(RETRY_SECONDS)
        del keeper


_keeper: LeaseKeeper | None = None
_keeper_lock = threading.Lock()


def get_keeper() -> LeaseKeeper:
    """Return this process's keeper, creating it on first use."""
    global _keeper
    keeper = _keeper
    if keeper is None:
        with _keeper_lock:
            if _keeper is None:
                _keeper = LeaseKeeper()
            keeper = _keeper
    return keeper


def _reset_after_fork() -> None:
    # The parent's keeper thread does not exist in the child, and the parent's holds
    # are not the child's to renew.
    global _keeper, _keeper_lock
    _keeper = None
    _keeper_lock = threading.Lock()


os.register_at_fork(after_in_child=_reset_after_fork)
