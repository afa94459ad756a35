"""A keyed in-memory limiter: a limit per key (a tenant, an API key, a user).

A key's limiter (``tenant.key("acme")``) is kept strongly while it holds a slot or a
request waits in it, else only weakly, so 100,000 tenants used once leave nothing
behind, and one key never has two limiters at once.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import weakref
from collections.abc import Mapping
from typing import Any, Literal, NoReturn, overload

from .base import ConfiguredLimiter
from .cancellation import CancellationToken
from .clock import SYSTEM_CLOCK, Clock
from .config import DEFAULT_LEASE_TTL_MS, Fairness, LimiterConfig, WorkloadConfig, limiter_config
from .errors import ConcurrencyConfigError
from .keys import check_key, config_for_key
from .memory import Coordinator, InMemoryConcurrencyLimiter, stats_of
from .protocol import (
    AcquireRequest,
    KeyStats,
    Lease,
    LimiterStats,
    OnWait,
    Outcome,
)

__all__ = ["KeyedInMemoryConcurrencyLimiter", "create_concurrency_limiter"]


class KeyedInMemoryConcurrencyLimiter(ConfiguredLimiter):
    """A limit per key, in one process; ``key(k)`` is the limiter of key ``k``."""

    def __init__(
        self,
        config: LimiterConfig,
        *,
        clock: Clock = SYSTEM_CLOCK,
        coordinator: Coordinator | None = None,
    ) -> None:
        if not config.keyed:
            raise ConcurrencyConfigError(
                f"limiter {config.name!r} is not keyed", limiter=config.name
            )
        super().__init__(config)
        self._clock = clock
        self._lock = threading.Lock()
        self._live: weakref.WeakValueDictionary[str, InMemoryConcurrencyLimiter] = (
            weakref.WeakValueDictionary()
        )
        self._busy: dict[str, InMemoryConcurrencyLimiter] = {}
        #: One fencing counter for every key: a key forgotten and made again continues
        #: above every token it gave.
        self._tokens = itertools.count(1)
        self._coordinator = Coordinator() if coordinator is None else coordinator

    def __repr__(self) -> str:
        config = self._config
        return f"<{type(self).__name__} {config.name!r} max={config.max_concurrent} per key>"

    def key(self, key: str) -> InMemoryConcurrencyLimiter:
        check_key(self._config.name, key, argument=f"{self._config.name}.key()")
        with self._lock:
            limiter = self._live.get(key)
            if limiter is None:
                limiter = InMemoryConcurrencyLimiter(
                    config_for_key(self._config, key),
                    clock=self._clock,
                    coordinator=self._coordinator,
                )
                limiter._owner = self
                limiter._key = key
                limiter._tokens = self._tokens
                self._live[key] = limiter
            return limiter

    def _key_busy(self, limiter: InMemoryConcurrencyLimiter) -> None:
        assert limiter._key is not None
        with self._lock:
            self._busy[limiter._key] = limiter

    def _key_idle(self, limiter: InMemoryConcurrencyLimiter) -> None:
        assert limiter._key is not None
        with self._lock:
            if self._busy.get(limiter._key) is limiter:
                del self._busy[limiter._key]

    def keys_in_use(self) -> int:
        with self._lock:
            return len(self._busy)

    def key_stats(self, limit: int | None = 100) -> list[KeyStats]:
        with self._lock:
            busy = list(self._busy.items())
        rows = []
        for key, limiter in busy:
            stats = limiter.stats()
            if stats.active or stats.queued:
                rows.append(KeyStats(key=key, active=stats.active, queued=stats.queued))
        count = len(rows) if limit is None else limit  # busiest first, then by key
        return heapq.nsmallest(count, rows, key=lambda row: (-row.active, -row.queued, row.key))

    def stats(self, *, per_key: bool = False, limit: int | None = 100) -> LimiterStats:
        with self._lock:
            busy = list(self._busy.values())
        active = dict.fromkeys(self._config.workloads, 0)
        queued = dict.fromkeys(self._config.workloads, 0)
        for limiter in busy:
            for name, workload in limiter.stats().workloads.items():
                active[name] += workload.active
                queued[name] += workload.queued
        return stats_of(active, queued, self.key_stats(limit) if per_key else ())

    def _refuse(self) -> NoReturn:
        name = self._config.name
        raise ConcurrencyConfigError(
            f"limiter {name!r} is keyed: it has a limit per key and no slots of its own; "
            f"use {name}.key(...) (e.g. slot({name}.key(tenant_id)))",
            limiter=name,
        )

    def validate_workload(self, workload: str | None) -> str:
        self._refuse()

    def acquire(
        self,
        request: AcquireRequest,
        *,
        cancel: CancellationToken | None = None,
        on_wait: OnWait | None = None,
    ) -> Lease:
        self._refuse()

    def renew(self, lease: Lease) -> Lease | None:
        return None  # it grants no leases

    def release(self, lease: Lease, outcome: Outcome = "success") -> None:
        return None


@overload
def create_concurrency_limiter(
    max_concurrent: int,
    *,
    max_queued: int | None = ...,
    workloads: Mapping[str, WorkloadConfig | Mapping[str, Any]] | None = ...,
    default_workload: str | None = ...,
    name: str = ...,
    lease_ttl_ms: int = ...,
    max_hold_ms: int | None = ...,
    fairness: Fairness = ...,
    keyed: Literal[False] = ...,
    clock: Clock = ...,
) -> InMemoryConcurrencyLimiter: ...


@overload
def create_concurrency_limiter(
    max_concurrent: int,
    *,
    max_queued: int | None = ...,
    workloads: Mapping[str, WorkloadConfig | Mapping[str, Any]] | None = ...,
    default_workload: str | None = ...,
    name: str = ...,
    lease_ttl_ms: int = ...,
    max_hold_ms: int | None = ...,
    fairness: Fairness = ...,
    keyed: Literal[True],
    clock: Clock = ...,
) -> KeyedInMemoryConcurrencyLimiter: ...


def create_concurrency_limiter(
    max_concurrent: int,
    *,
    max_queued: int | None = None,
    workloads: Mapping[str, WorkloadConfig | Mapping[str, Any]] | None = None,
    default_workload: str | None = None,
    name: str = "default",
    lease_ttl_ms: int = DEFAULT_LEASE_TTL_MS,
    max_hold_ms: int | None = None,
    fairness: Fairness = "fifo",
    keyed: bool = False,
    clock: Clock = SYSTEM_CLOCK,
) -> InMemoryConcurrencyLimiter | KeyedInMemoryConcurrencyLimiter:
    """Create a limiter shared by the threads and coroutines of this process (options of
    :class:`~runcell_celery.config.LimiterConfig`; ``keyed=True``: a limit per key).

    >>> claude = create_concurrency_limiter(
    ...     8, name="claude", workloads={"interactive": {"reserved": 2}, "background": {}}
    ... )
    """
    config = limiter_config(
        max_concurrent,
        max_queued=max_queued,
        workloads=workloads,
        default_workload=default_workload,
        name=name,
        lease_ttl_ms=lease_ttl_ms,
        max_hold_ms=max_hold_ms,
        fairness=fairness,
        keyed=keyed,
    )
    if config.keyed:
        return KeyedInMemoryConcurrencyLimiter(config, clock=clock)
    return InMemoryConcurrencyLimiter(config, clock=clock)
