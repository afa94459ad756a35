"""The keys of a keyed PostgreSQL limiter, in this process.

A keyed limiter is stored as one template row; each key is a limiter row of its own,
``"<limiter>:<key>"``, created by the first operation that names it (no extra round
trip) and purged once idle. Here: the keys' limiter objects (built without I/O, cached
LRU), a purge loop started by the first key used (every :data:`PURGE_INTERVAL_S`, in
batches, skipping keys in use), and per-key counts for operators.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Generic, LiteralString, Protocol, Self, TypeVar

from ..background import BackgroundLoop
from ..config import LimiterConfig
from ..keys import check_key, split_key_name
from ..protocol import KeyStats, LimiterStats, WorkloadStats
from . import statements
from .engine import HasEngine

#: How often a process that uses keys deletes the idle ones (seconds).
PURGE_INTERVAL_S = 10.0
#: Keys deleted per purge statement; a full batch is followed by another at once.
PURGE_BATCH = 10_000
#: A key's round-robin history is forgotten once it was last served this long ago and
#: has nothing waiting (it is then served like a new key): milliseconds.
FAIR_HISTORY_IDLE_MS = 60_000
#: Key limiter objects kept per keyed limiter in a process (rebuilt without I/O).
CACHED_KEYS = 4_096


class KeyLimiter(Protocol):
    """What a key set needs of its keyed limiter (whose keys' limiters are alike)."""

    @property
    def name(self) -> str: ...

    @property
    def config(self) -> LimiterConfig: ...

    @property
    def engines(self) -> HasEngine: ...

    def for_key(self, key: str) -> Self: ...

    def reap(self) -> None: ...

    def call_database(self, query: LiteralString, params: Mapping[str, Any]) -> Any: ...

    def fetch(self, query: LiteralString, params: Mapping[str, Any]) -> list[tuple[Any, ...]]: ...


L = TypeVar("L", bound=KeyLimiter)


class KeySet(Generic[L]):
    """The keys of one keyed limiter: their limiter objects, purge and counts."""

    def __init__(self, parent: L) -> None:
        self._parent = parent
        self._cache: OrderedDict[str, L] = OrderedDict()
        self._lock = threading.Lock()
        #: Whether the purge loop has waited its first interval.
        self.purging = False
        self._purger: BackgroundLoop[KeySet[L]] = BackgroundLoop(
            f"runcell-keys-{parent.name}", self, _purge_step, retry_s=PURGE_INTERVAL_S
        )

    def get(self, key: str) -> L:
        """The limiter of ``key`` (checked: :func:`runcell_celery.keys.check_key`)."""
        parent = self._parent
        check_key(parent.name, key, argument=f"{parent.name}.key()")
        with self._lock:
            found = self._cache.get(key)
            if found is not None:
                self._cache.move_to_end(key)
                return found
        limiter = parent.for_key(key)
        with self._lock:
            limiter = self._cache.setdefault(key, limiter)
            while len(self._cache) > CACHED_KEYS:
                self._cache.popitem(last=False)
        parent.engines.engine.track(self._purger)
        self._purger.start()
        return limiter

    def purge(self, limit: int = PURGE_BATCH) -> int:
        """Delete up to ``limit`` idle keys now; return how many went."""
        params = {"parent": self._parent.name, "limit": limit}
        return int(self._parent.call_database(statements.PURGE_IDLE_KEYS, params) or 0)

    def purge_fair_history(
        self, *, idle_ms: int = FAIR_HISTORY_IDLE_MS, limit: int = PURGE_BATCH
    ) -> int:
        """Forget the round-robin history of keys served over ``idle_ms`` ago with
        nothing waiting (in every round-robin limiter, not only this one: keys are
        shared names); return how many rows went."""
        params = {"idle_ms": idle_ms, "limit": limit}
        return int(self._parent.call_database(statements.PURGE_FAIR_HISTORY, params) or 0)

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

    def stats(self, *, limit: int | None = 100, search: str | None = None) -> list[KeyStats]:
        """The keys in use, busiest first (most slots held, then most waiting), at most
        ``limit`` (``None``: all); ``search``: only keys containing it (any case)."""
        params = {"parent": self._parent.name, "limit": limit, "search": search}
        rows = self._parent.fetch(statements.KEY_STATS, params)
        out: list[KeyStats] = []
        for name, held, waiting in rows:
            key = split_key_name(name)[1]
            if key is not None:
                out.append(KeyStats(key=key, active=int(held), queued=int(waiting)))
        return out

    def in_use(self) -> int:
        """How many keys hold a slot or have a request waiting."""
        rows = self._parent.fetch(statements.KEYS_IN_USE, {"parent": self._parent.name})
        return int(rows[0][0]) if rows else 0

    def totals(self, *, per_key: bool = False, limit: int | None = 100) -> LimiterStats:
        """Slots held and requests waiting over every key, per workload; with
        ``per_key`` also the keys in use (:meth:`stats`)."""
        rows = self._parent.fetch(statements.KEYED_TOTALS, {"parent": self._parent.name})
        keys = self.stats(limit=limit) if per_key else ()
        return counted_stats(self._parent.config.workloads, rows, keys=keys)


def counted_stats(
    workloads: Iterable[str], rows: Iterable[Sequence[Any]], *, keys: Sequence[KeyStats] = ()
) -> LimiterStats:
    """Stats from ``(workload, held, waiting)`` rows; ``workloads`` (configured) first,
    each shown even when idle."""
    active = dict.fromkeys(workloads, 0)
    queued = dict.fromkeys(workloads, 0)
    for workload, held, waiting in rows:
        active[workload] = int(held or 0)
        queued[workload] = int(waiting or 0)
    return LimiterStats(
        active=sum(active.values()),
        queued=sum(queued.values()),
        workloads={w: WorkloadStats(active=active[w], queued=queued[w]) for w in active},
        keys=keys,
    )


def _purge_step(keys: KeySet[Any]) -> float:
    if not keys.purging:
        keys.purging = True  # the loop starts with the first key used: nothing is idle yet
        return PURGE_INTERVAL_S
    purged = keys.purge()
    forgotten = keys.purge_fair_history()
    return 0.0 if max(purged, forgotten) >= PURGE_BATCH else PURGE_INTERVAL_S
