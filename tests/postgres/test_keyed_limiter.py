"""Keyed PostgreSQL limiters: a limit per key, key rows made on first use and purged
once idle, fencing tokens that never repeat, and what operators read per key."""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable

import psycopg
import pytest

from runcell_celery import (
    AcquireRequest,
    ConcurrencyConfigError,
    ConcurrencyTimeoutError,
    KeyStats,
    RunLineage,
    slot,
)
from runcell_celery.postgres import PostgresConcurrencyLimiter, create_postgres_concurrency_limiter
from runcell_celery.postgres import keyed as keyed_module
from tests.support.pg import unique_name

MakeLimiter = Callable[..., PostgresConcurrencyLimiter]


@pytest.fixture(autouse=True)
def no_purge_loop_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Key rows are counted here: the process's purge loop must not delete them between
    two counts (the test of the loop itself shortens the interval again)."""
    monkeypatch.setattr(keyed_module, "PURGE_INTERVAL_S", 3600.0)


def key_rows(dsn: str, parent: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT count(*) FROM runcell_limiter WHERE parent = %s", [parent]
        ).fetchone()
    assert row is not None
    return int(row[0])


#: Waits end after 100 ms, so a key at its limit shows as a timeout.
SHORT_WAIT = {"default": {"max_wait_ms": 100}}


def test_each_key_has_its_own_limit(make_limiter: MakeLimiter) -> None:
    tenant = make_limiter(max_concurrent=1, keyed=True, workloads=SHORT_WAIT)
    with slot(tenant.key("acme")):
        with slot(tenant.key("globex")):  # another key: a slot of its own
            pass
        waiting = slot(tenant.key("acme"))
        with pytest.raises(ConcurrencyTimeoutError, match=f"{tenant.name}:acme"), waiting:
            pass  # pragma: no cover - never entered


def test_a_keyed_limiter_itself_holds_no_slot(make_limiter: MakeLimiter) -> None:
    tenant = make_limiter(max_concurrent=1, keyed=True)
    keyed_itself = slot(tenant)
    expected = "is keyed: a slot names one of its keys"
    with pytest.raises(ConcurrencyConfigError, match=expected), keyed_itself:
        pass  # pragma: no cover - never entered


def test_only_a_keyed_limiter_has_keys(make_limiter: MakeLimiter) -> None:
    with pytest.raises(ConcurrencyConfigError, match="is not keyed"):
        make_limiter(max_concurrent=1).key("acme")


def test_an_invalid_key_is_refused_before_the_database_is_asked(make_limiter: MakeLimiter) -> None:
    tenant = make_limiter(max_concurrent=1, keyed=True)
    with pytest.raises(ConcurrencyConfigError, match="control characters"):
        tenant.key("acme\n")
    with pytest.raises(ConcurrencyConfigError, match="at most 128 characters"):
        tenant.key("x" * 129)


def test_the_limit_per_key_holds_across_threads(make_limiter: MakeLimiter) -> None:
    tenant = make_limiter(max_concurrent=1, keyed=True)
    in_flight: Counter[str] = Counter()
    most: Counter[str] = Counter()
    lock = threading.Lock()
    failures: list[BaseException] = []

    def call(key: str) -> None:
        try:
            with slot(tenant.key(key)):
                with lock:
                    in_flight[key] += 1
                    most[key] = max(most[key], in_flight[key])
                time.sleep(0.003)
                with lock:
                    in_flight[key] -= 1
        except BaseException as exc:
            failures.append(exc)

    threads = [
        threading.Thread(target=call, args=(f"t{i % 5}",)) for i in range(40)
    ]  # 5 tenants x 8 calls
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not failures
    assert set(most) == {f"t{i}" for i in range(5)}
    assert max(most.values()) == 1


def test_keys_used_once_leave_no_rows_once_purged(pg_dsn: str, make_limiter: MakeLimiter) -> None:
    tenant = make_limiter(max_concurrent=2, keyed=True)
    for i in range(300):
        with slot(tenant.key(f"tenant-{i}")):
            pass
    assert key_rows(pg_dsn, tenant.name) == 300
    assert tenant.purge_idle_keys() == 300
    assert key_rows(pg_dsn, tenant.name) == 0


def test_a_hundred_thousand_idle_keys_are_all_purged(
    pg_dsn: str, make_limiter: MakeLimiter
) -> None:
    tenant = make_limiter(max_concurrent=2, keyed=True)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        # Made the way an operation makes a key, 100,000 times in one statement.
        conn.execute(
            "SELECT runcell_create_key(%s || ':' || i) FROM generate_series(1, 100000) i",
            [tenant.name],
        )
    assert key_rows(pg_dsn, tenant.name) == 100_000
    purged = 0
    while (batch := tenant.purge_idle_keys()) > 0:
        purged += batch
    assert purged == 100_000
    assert key_rows(pg_dsn, tenant.name) == 0


def test_the_process_purges_idle_keys_by_itself(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(keyed_module, "PURGE_INTERVAL_S", 0.2)
    tenant = create_postgres_concurrency_limiter(
        pg_dsn, name=unique_name(), max_concurrent=1, keyed=True
    )
    for i in range(50):
        with slot(tenant.key(f"k{i}")):
            pass
    deadline = time.monotonic() + 15
    while key_rows(pg_dsn, tenant.name) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert key_rows(pg_dsn, tenant.name) == 0


def test_a_key_in_use_is_never_purged(pg_dsn: str, make_limiter: MakeLimiter) -> None:
    tenant = make_limiter(max_concurrent=1, keyed=True, workloads=SHORT_WAIT)
    with slot(tenant.key("busy")):
        assert tenant.purge_idle_keys() == 0
        assert key_rows(pg_dsn, tenant.name) == 1
        with pytest.raises(ConcurrencyTimeoutError), slot(tenant.key("busy")):
            pass  # pragma: no cover - never entered: the key holds its one slot
        assert tenant.purge_idle_keys() == 0
    assert tenant.purge_idle_keys() == 1


def test_a_key_made_again_after_a_purge_never_repeats_a_fencing_token(
    make_limiter: MakeLimiter,
) -> None:
    tenant = make_limiter(max_concurrent=1, keyed=True)
    seen: list[int] = []
    for _ in range(4):
        for _ in range(3):
            with slot(tenant.key("acme")) as held:
                assert held.fencing_token is not None
                seen.append(held.fencing_token)
        assert tenant.purge_idle_keys() == 1
    assert seen == sorted(seen)
    assert len(set(seen)) == len(seen)


def test_key_stats_list_the_busiest_keys_in_use_and_search_them(make_limiter: MakeLimiter) -> None:
    tenant = make_limiter(max_concurrent=3, keyed=True)
    with slot(tenant.key("idle")):
        pass  # its row stays until purged, but it is not in use
    with slot(tenant.key("acme")), slot(tenant.key("acme")), slot(tenant.key("globex")):
        assert tenant.key_stats(limit=1) == [KeyStats("acme", active=2, queued=0)]
        assert [k.key for k in tenant.key_stats()] == ["acme", "globex"]
        assert [k.key for k in tenant.key_stats(search="GLOB")] == ["globex"]
        assert tenant.keys_in_use() == 2
        totals = tenant.stats(per_key=True)
        assert (totals.active, totals.queued) == (3, 0)
        assert [k.key for k in totals.keys] == ["acme", "globex"]
        assert tenant.stats().keys == ()
    assert tenant.keys_in_use() == 0


def test_replaced_limits_reach_the_keys_in_use(pg_dsn: str) -> None:
    name = unique_name()
    tenant = create_postgres_concurrency_limiter(pg_dsn, name=name, max_concurrent=1, keyed=True)
    with slot(tenant.key("busy")):
        with slot(tenant.key("idle")):
            pass
        wider = create_postgres_concurrency_limiter(
            pg_dsn, name=name, max_concurrent=2, keyed=True, on_conflict="replace"
        )
        assert key_rows(pg_dsn, name) == 1  # the idle key went; the busy one stays
        with slot(wider.key("busy")):  # its second slot, under the new limit
            pass


def test_a_limiter_named_like_a_key_is_refused(pg_dsn: str, make_limiter: MakeLimiter) -> None:
    tenant = make_limiter(max_concurrent=1, keyed=True)
    with pytest.raises(ConcurrencyConfigError, match=r"is named like key 'acme'"):
        create_postgres_concurrency_limiter(pg_dsn, name=f"{tenant.name}:acme", max_concurrent=1)


def test_round_robin_serves_a_tenants_one_call_within_two_grants_of_anothers_fifty(
    make_limiter: MakeLimiter,
) -> None:
    provider = make_limiter(max_concurrent=1, fairness="round_robin")
    order: list[str] = []
    lock = threading.Lock()

    def call(key: str) -> None:
        with slot(provider, key=key):
            with lock:
                order.append(key)
            time.sleep(0.002)

    threads: list[threading.Thread] = []
    with slot(provider, key="A"):
        for i, key in enumerate(["A"] * 50 + ["B"]):
            thread = threading.Thread(target=call, args=(key,))
            thread.start()
            threads.append(thread)
            deadline = time.monotonic() + 15
            while provider.stats().queued < i + 1 and time.monotonic() < deadline:
                time.sleep(0.005)  # queued in this order: A's 50, then B's one
        assert provider.stats().queued == 51
    for thread in threads:
        thread.join(60)
    assert len(order) == 51
    assert "B" in order[:2], order[:5]


def test_the_round_robin_history_of_idle_keys_is_forgotten_and_a_waiting_keys_kept(
    pg_dsn: str, make_limiter: MakeLimiter
) -> None:
    provider = make_limiter(max_concurrent=1, fairness="round_robin")
    tenants = make_limiter(max_concurrent=5, keyed=True)
    tags = [unique_name("tenant") for _ in range(3)]
    for tag in tags:  # each tenant served once, through its key's limiter and the provider
        with slot(provider, tenants.key(tag)):
            pass
    waiting = tags[0]
    held = provider.acquire(_request("holder"))
    queued = threading.Thread(target=_one_call, args=(provider, tenants, waiting))
    queued.start()
    try:
        deadline = time.monotonic() + 15
        while provider.stats().queued < 1 and time.monotonic() < deadline:
            time.sleep(0.005)

        tenants._key_set().purge_fair_history(idle_ms=0)

        assert _history(pg_dsn, provider.name) == {waiting}, "a key still waiting lost its turn"
    finally:
        provider.release(held)
        queued.join(30)
    tenants._key_set().purge_fair_history(idle_ms=0)
    assert _history(pg_dsn, provider.name) == set()


def _one_call(
    provider: PostgresConcurrencyLimiter, tenants: PostgresConcurrencyLimiter, key: str
) -> None:
    with slot(provider, tenants.key(key)):
        pass


def _request(name: str) -> AcquireRequest:
    request_id = unique_name(name)
    return AcquireRequest(
        request_id=request_id, workload="default", lineage=RunLineage(request_id, request_id)
    )


def _history(dsn: str, limiter: str) -> set[str]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT fair_key FROM runcell_fair_history WHERE limiter = %s", [limiter]
        ).fetchall()
    return {row[0] for row in rows}


def test_first_come_first_served_is_the_default_between_keys(make_limiter: MakeLimiter) -> None:
    provider = make_limiter(max_concurrent=1)
    order: list[str] = []

    def call(key: str) -> None:
        with slot(provider, key=key):
            order.append(key)

    threads: list[threading.Thread] = []
    with slot(provider):
        for i, key in enumerate(["A"] * 5 + ["B"]):
            thread = threading.Thread(target=call, args=(key,))
            thread.start()
            threads.append(thread)
            deadline = time.monotonic() + 15
            while provider.stats().queued < i + 1 and time.monotonic() < deadline:
                time.sleep(0.005)
    for thread in threads:
        thread.join(30)
    assert order == ["A"] * 5 + ["B"]


def test_an_allocation_pass_on_the_keyed_limiter_reaps_its_keys_dead_holders(
    make_limiter: MakeLimiter,
) -> None:
    # The sweeper knows the keyed limiter's name only: its pass must reach the keys.
    tenant = make_limiter(max_concurrent=1, keyed=True, lease_ttl_ms=200)
    acme = tenant.key("acme")
    rid = uuid.uuid4().hex
    lease = acme.acquire(AcquireRequest(rid, None, RunLineage(rid, rid)))  # never renewed
    assert lease.fencing_token > 0
    assert acme.stats().active == 1
    time.sleep(0.4)  # the lease expires; its holder is "dead"
    tenant.reap()
    assert acme.stats().active == 0
