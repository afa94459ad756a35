"""Keyed limiters and fairness by key, in memory.

``create_concurrency_limiter(2, name="tenant", keyed=True)`` gives every key its own
limit; ``tenant.key("acme")`` is the limiter of that key, created on first use and
forgotten once idle. ``fairness="round_robin"`` serves waiting requests of one
workload round-robin by key (the key of the keyed limiter a request also names, or an
explicit ``key=``). Real threads; the order of grants is read from the bodies, which
run one at a time at a limit of 1.
"""

from __future__ import annotations

import functools
import gc
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import pytest

from runcell_celery import (
    ConcurrencyConfigError,
    InMemoryConcurrencyLimiter,
    KeyedInMemoryConcurrencyLimiter,
    KeyStats,
    create_concurrency_limiter,
    slot,
)
from runcell_celery.memory import HISTORY_LIMIT
from runcell_celery.protocol import SupportsKeys
from tests.core.conftest import direct_request

SOON_S = 10.0


def wait_until(check: Callable[[], object], what: str) -> None:
    deadline = time.monotonic() + SOON_S
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(0.002)


# -- keys ------------------------------------------------------------------------------------


def test_each_key_of_a_keyed_limiter_has_its_own_limit_with_the_same_settings() -> None:
    tenants = create_concurrency_limiter(
        2, name="kl-tenant", keyed=True, workloads={"default": {}, "batch": {}}
    )
    assert isinstance(tenants, KeyedInMemoryConcurrencyLimiter)
    assert isinstance(tenants, SupportsKeys)
    acme, globex = tenants.key("acme"), tenants.key("globex")
    assert isinstance(acme, InMemoryConcurrencyLimiter)
    assert (acme.name, globex.name) == ("kl-tenant:acme", "kl-tenant:globex")
    assert acme.config.max_concurrent == 2
    assert set(acme.config.workloads) == {"default", "batch"}
    assert not acme.config.keyed
    with slot(acme), slot(acme), slot(globex):
        assert tenants.key("acme") is acme
        assert (acme.stats().active, globex.stats().active) == (2, 1)
        stats = tenants.stats(per_key=True)
        assert (stats.active, stats.queued) == (3, 0)
        assert stats.keys == [KeyStats("acme", 2, 0), KeyStats("globex", 1, 0)]
        assert tenants.key_stats(limit=1) == [KeyStats("acme", 2, 0)]
        assert tenants.stats().keys == ()
    assert tenants.stats(per_key=True).keys == []


def test_a_key_is_validated_before_it_names_a_limiter() -> None:
    tenants = create_concurrency_limiter(1, name="kv-tenant", keyed=True)
    for bad in ["", "   ", "a" * 129, "line\nbreak", 42]:
        with pytest.raises(ConcurrencyConfigError, match="invalid"):
            tenants.key(bad)  # type: ignore[arg-type]
    assert tenants.keys_in_use() == 0


def test_a_key_in_use_keeps_its_limiter_and_an_idle_one_is_forgotten() -> None:
    tenants = create_concurrency_limiter(1, name="kf-tenant", keyed=True)
    lease = tenants.key("acme").acquire(direct_request())
    gc.collect()
    # Nobody but the keyed limiter references the busy key: it is kept, with its slot.
    acme = tenants.key("acme")
    assert acme.stats().active == 1
    assert tenants.keys_in_use() == 1
    ref = weakref.ref(acme)
    del acme
    tenants.key("acme").release(lease)
    assert tenants.keys_in_use() == 0
    gc.collect()
    assert ref() is None, "an idle key's limiter was kept"


def test_100000_keys_used_once_leave_no_key_state() -> None:
    provider = create_concurrency_limiter(4, name="many-provider", fairness="round_robin")
    tenants = create_concurrency_limiter(1, name="many-tenant", keyed=True)
    refs: list[weakref.ref[InMemoryConcurrencyLimiter]] = []
    for i in range(100_000):
        key = tenants.key(f"tenant-{i}")
        if i % 2:
            with slot(provider, key):
                pass
        else:
            with slot(key):
                pass
        if i % 10_000 == 0:
            refs.append(weakref.ref(key))
    del key
    assert tenants.keys_in_use() == 0
    assert tenants.stats(per_key=True).keys == []
    assert len(tenants._live) == 0, "key limiters are still referenced"
    assert all(ref() is None for ref in refs)
    coordinator = provider._root()
    with coordinator.lock:
        assert not any(provider in w.limiters for w in coordinator.waiting)
        assert id(provider) not in coordinator.members
    assert provider._history is not None
    assert len(provider._history) <= HISTORY_LIMIT
    assert provider.stats().active == 0


def test_a_keyed_limiter_used_directly_raises_telling_to_name_a_key() -> None:
    tenants = create_concurrency_limiter(1, name="kd2-tenant", keyed=True)
    with pytest.raises(ConcurrencyConfigError, match=r"kd2-tenant\.key\("):
        tenants.acquire(direct_request())
    with pytest.raises(ConcurrencyConfigError, match=r"kd2-tenant\.key\("), slot(tenants):
        pass
    assert tenants.keys_in_use() == 0


# -- fairness --------------------------------------------------------------------------------


def _queued(limiter: InMemoryConcurrencyLimiter, count: int) -> bool:
    return limiter.stats().queued == count


def _queue_then_release(
    provider: InMemoryConcurrencyLimiter, make: Callable[[str], Any]
) -> list[str]:
    """Hold the provider's one slot; tenant A queues 50 requests, then tenant B one;
    release, and return the order the 51 bodies ran in."""
    order: list[str] = []
    lock = threading.Lock()

    def call(key: str) -> None:
        with make(key), lock:
            order.append(key)

    threads: list[threading.Thread] = []
    first = provider.acquire(direct_request())
    try:
        for n, key in enumerate(["A"] * 50 + ["B"]):
            thread = threading.Thread(target=call, args=(key,))
            thread.start()
            threads.append(thread)
            wait_until(functools.partial(_queued, provider, n + 1), f"request {n} queued")
    finally:
        provider.release(first)
    for thread in threads:
        thread.join(SOON_S)
    assert not any(t.is_alive() for t in threads)
    return order


def test_round_robin_grants_a_tenant_with_one_request_within_two_grants_of_a_busy_one() -> None:
    provider = create_concurrency_limiter(1, name="rr-provider", fairness="round_robin")
    tenants = create_concurrency_limiter(100, name="rr-tenant", keyed=True)
    order = _queue_then_release(provider, lambda key: slot(provider, tenants.key(key)))
    assert sorted(order) == ["A"] * 50 + ["B"]
    assert "B" in order[:2], order


def test_round_robin_by_an_explicit_key_on_one_limiter() -> None:
    provider = create_concurrency_limiter(1, name="rr1-provider", fairness="round_robin")
    order = _queue_then_release(provider, lambda key: slot(provider, key=key))
    assert "B" in order[:2], order


def test_first_come_first_served_makes_the_one_request_wait_behind_all_fifty() -> None:
    provider = create_concurrency_limiter(1, name="fifo-provider")
    tenants = create_concurrency_limiter(100, name="fifo-tenant", keyed=True)
    order = _queue_then_release(provider, lambda key: slot(provider, tenants.key(key)))
    assert order.index("B") == 50


def test_round_robin_keeps_every_limit_under_threads() -> None:
    provider = create_concurrency_limiter(3, name="rrl-provider", fairness="round_robin")
    tenants = create_concurrency_limiter(1, name="rrl-tenant", keyed=True)
    lock = threading.Lock()
    now: dict[str, int] = {}
    peak: dict[str, int] = {}

    def enter(*names: str) -> None:
        with lock:
            for name in names:
                now[name] = now.get(name, 0) + 1
                peak[name] = max(peak.get(name, 0), now[name])

    def leave(*names: str) -> None:
        with lock:
            for name in names:
                now[name] -= 1

    def work(i: int) -> None:
        for n in range(50):
            key = f"k{(i + n) % 5}"
            names = ("rrl-provider", f"rrl-tenant:{key}")
            with slot(provider, tenants.key(key)):
                enter(*names)
                time.sleep(0.0002)
                leave(*names)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(10)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(t.is_alive() for t in threads)
    assert peak["rrl-provider"] <= 3
    assert all(v <= 1 for k, v in peak.items() if k.startswith("rrl-tenant:"))
    assert tenants.keys_in_use() == 0


def test_the_in_memory_backend_builds_a_keyed_limiter_from_keyed_limits() -> None:
    from runcell_celery.backends import MemoryBackend
    from runcell_celery.config import limiter_config

    backend = MemoryBackend()
    keyed = backend.create_limiter(limiter_config(2, name="kb-tenant", keyed=True))
    plain = backend.create_limiter(limiter_config(2, name="kb-openai"))
    assert isinstance(keyed, KeyedInMemoryConcurrencyLimiter)
    assert isinstance(plain, InMemoryConcurrencyLimiter)
    with slot(plain, keyed.key("acme")) as held:
        assert [x.limiter for x in held.leases] == ["kb-openai", "kb-tenant:acme"]
