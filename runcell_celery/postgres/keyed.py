"""The keys of a keyed PostgreSQL limiter, in this process.

A keyed limiter (``keyed=True``) is stored as one row, the template; each key is a
limiter row of its own, ``"<limiter>:<key>"``, which the database creates on the first
operation that names it (``runcell_create_key_v5``: no registration round trip, so a
key's first acquire is still one round trip) and deletes once idle
(``runcell_purge_idle_keys_v5``). This module keeps what the process needs besides:

* the key's limiter objects, built without I/O and cached (least recently used first
  out), since a fleet may see 100,000 tenants;
* a purge loop, started by the first key used in the process: every
  :data:`PURGE_INTERVAL_S` it deletes idle keys in batches (any process may: the
  purge skips keys in use and never waits for one);
* per-key counts for operators (the busiest keys, searchable) and the totals over all
  keys.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

from ..background import BackgroundLoop
from ..keys import check_key, config_for_key, split_key_name
from ..protocol import LimiterStats, WorkloadStats
from . import statements

if TYPE_CHECKING:
    from .limiter import PostgresConcurrencyLimiter

__all__ = ["PURGE_BATCH", "PURGE_INTERVAL_S", "KeySet"]

#: How often a process that uses keys deletes the idle ones (seconds).
PURGE_INTERVAL_S = 10.0
#: Keys deleted per purge statement; a full batch is followed by another at once.
PURGE_BATCH = 10_000
#: Key limiter objects kept per keyed limiter in a process (rebuilt without I/O).
CACHED_KEYS = 4_096


class KeySet:
    """The keys of one keyed limiter: their limiter objects, purge and counts."""

    def __init__(self, parent: PostgresConcurrencyLimiter) -> None:
        self._parent = parent
        self._cache: OrderedDict[str, PostgresConcurrencyLimiter] = OrderedDict()
        self._lock = threading.Lock()
        self._purger: BackgroundLoop[KeySet] = BackgroundLoop(
            f"runcell-keys-{parent.name}", self, _purge_step, retry_s=PURGE_INTERVAL_S
        )

    def get(self, key: str) -> PostgresConcurrencyLimiter:
        """The limiter of ``key`` (checked: :func:`runcell_celery.keys.check_key`)."""
        parent = self._parent
        with self._lock:
            found = self._cache.get(key)
            if found is not None:
                self._cache.move_to_end(key)
                return found
        check_key(parent.name, key)
        from .limiter import PostgresConcurrencyLimiter

        limiter = PostgresConcurrencyLimiter(
            parent.database,
            config_for_key(parent.config, key),
            parent.options,
            stored_hash=parent.stored_hash,
        )
        limiter.set_parked_granted_handler(parent.parked_granted_handler)
        with self._lock:
            limiter = self._cache.setdefault(key, limiter)
            while len(self._cache) > CACHED_KEYS:
                self._cache.popitem(last=False)
        self._purger.start()
        return limiter

    def purge(self, limit: int = PURGE_BATCH) -> int:
        """Delete up to ``limit`` idle keys now; return how many went."""
        params = {"parent": self._parent.name, "limit": limit}
        return int(self._parent.call_database(statements.PURGE_IDLE_KEYS, params) or 0)

    def reap_expired(self) -> int:
        """Run an allocation pass on every key that has an expired lease (a dead
        holder's slot, a parked grant nobody claimed); return how many keys."""
        rows = self._parent.fetch(
            statements.KEYS_WITH_EXPIRED_LEASES, {"parent": self._parent.name}
        )
        for (name,) in rows:
            key = split_key_name(name)[1]
            if key is not None:
                self.get(key).reap()
        return len(rows)

    def stats(self, *, limit: int = 20, search: str | None = None) -> dict[str, LimiterStats]:
        """Counts of the busiest keys (most slots held, then most waiting), at most
        ``limit``; ``search``: only keys containing it (case-insensitive)."""
        params = {"parent": self._parent.name, "limit": limit, "search": search}
        rows = self._parent.fetch(statements.KEY_STATS, params)
        out: dict[str, LimiterStats] = {}
        for name, workloads, active, waiting in rows:
            key = split_key_name(name)[1]
            if key is not None:
                out[key] = _stats(list(workloads or ()), active, waiting)
        return out

    def totals(self) -> LimiterStats:
        """Slots held and requests waiting over every key, per workload."""
        rows = self._parent.fetch(statements.KEYED_TOTALS, {"parent": self._parent.name})
        workloads = list(self._parent.config.workloads)
        active = dict.fromkeys(workloads, 0)
        queued = dict.fromkeys(workloads, 0)
        for workload, held, waiting in rows:
            active[workload] = int(held or 0)
            queued[workload] = int(waiting or 0)
        return LimiterStats(
            active=sum(active.values()),
            queued=sum(queued.values()),
            workloads={w: WorkloadStats(active=active[w], queued=queued[w]) for w in active},
        )

    def stop(self) -> None:
        self._purger.stop()


def _purge_step(keys: KeySet) -> float:
    return 0.0 if keys.purge() >= PURGE_BATCH else PURGE_INTERVAL_S


def _stats(
    workloads: list[str], active: list[int] | None, waiting: list[int] | None
) -> LimiterStats:
    held = {w: int(active[i]) if active and i < len(active) else 0 for i, w in enumerate(workloads)}
    queued = {
        w: int(waiting[i]) if waiting and i < len(waiting) else 0 for i, w in enumerate(workloads)
    }
    return LimiterStats(
        active=sum(held.values()),
        queued=sum(queued.values()),
        workloads={w: WorkloadStats(active=held[w], queued=queued[w]) for w in workloads},
    )
