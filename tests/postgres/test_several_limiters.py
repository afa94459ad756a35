"""Several PostgreSQL limiters in one slot: granted together, never part held while
waiting, never deadlocked, never holding up the requests behind them."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

from runcell_celery import (
    CancellationToken,
    ConcurrencyCancelledError,
    ConcurrencyConfigError,
    ConcurrencyLimiterError,
    ConcurrencyTimeoutError,
    run,
    slot,
)
from runcell_celery.conformance import members_conformance_cases
from runcell_celery.postgres import PostgresConcurrencyLimiter, create_postgres_concurrency_limiter
from tests.support.pg import unique_name
from tests.support.reply_dropper import ReplyDropper

MakeLimiter = Callable[..., PostgresConcurrencyLimiter]


def deadlocks(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()"
        ).fetchone()
    assert row is not None
    return int(row[0])


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.01)


def test_two_limiters_named_in_opposite_orders_a_thousand_times_never_deadlock(
    pg_dsn: str, make_limiter: MakeLimiter
) -> None:
    a = make_limiter(max_concurrent=1)
    b = make_limiter(max_concurrent=1)
    before = deadlocks(pg_dsn)
    failures: list[BaseException] = []
    in_flight = [0]
    most = [0]
    lock = threading.Lock()

    def calls(i: int) -> None:
        try:
            for _ in range(125):  # 8 threads x 125 = 1,000 calls
                with slot(a, b) if i % 2 else slot(b, a):
                    with lock:
                        in_flight[0] += 1
                        most[0] = max(most[0], in_flight[0])
                    with lock:
                        in_flight[0] -= 1
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=calls, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(240)
    assert not any(thread.is_alive() for thread in threads), "a call never finished"
    assert failures == []
    assert most[0] == 1
    assert deadlocks(pg_dsn) == before, "PostgreSQL broke a deadlock"
    assert (a.stats().active, b.stats().active, a.stats().queued, b.stats().queued) == (
        0,
        0,
        0,
        0,
    )


def test_a_request_waiting_behind_others_elsewhere_does_not_hold_up_those_behind_it(
    make_limiter: MakeLimiter,
) -> None:
    shared = make_limiter(max_concurrent=2)
    busy = make_limiter(max_concurrent=1)
    granted: list[str] = []

    def take(name: str, *limiters: PostgresConcurrencyLimiter) -> None:
        with slot(*limiters):
            granted.append(name)

    with slot(busy):
        ahead = threading.Thread(target=take, args=("ahead", busy))
        ahead.start()
        wait_for(lambda: busy.stats().queued == 1, "a request queued on busy")
        both = threading.Thread(target=take, args=("both", shared, busy))
        both.start()
        wait_for(lambda: busy.stats().queued == 2, "the request over both queued")
        # Room in `shared`, and the request ahead of these lacks room in `busy` (it
        # holds nothing while it waits): both singles get their slots at once.
        with slot(shared), run(timeout_ms=5_000), slot(shared):
            assert shared.stats().active == 2
            granted.append("singles")
    for thread in (ahead, both):
        thread.join(15)
    assert granted[0] == "singles"
    assert sorted(granted[1:]) == ["ahead", "both"]


def test_a_request_waiting_for_another_limiter_keeps_no_room_where_it_has_it(
    make_limiter: MakeLimiter,
) -> None:
    # The waiting rule: until it is aged (GROUP_AGEING_MS, see test_group_waiting_rule),
    # a request over several limiters that lacks room elsewhere holds nothing here.
    shared = make_limiter(max_concurrent=2)
    busy = make_limiter(max_concurrent=1)
    stop = CancellationToken()
    outcome: list[str] = []

    def wait_for_both() -> None:
        try:
            with run(cancel=stop), slot(shared, busy):
                outcome.append("granted")  # pragma: no cover - busy is never freed
        except ConcurrencyCancelledError:
            outcome.append("cancelled")

    with slot(busy):
        both = threading.Thread(target=wait_for_both)
        both.start()
        wait_for(lambda: busy.stats().queued == 1, "the request over both queued")
        # Both slots of `shared` go to singles at once, the request over both waiting.
        with run(timeout_ms=1_000), slot(shared), slot(shared):
            assert shared.stats().active == 2
        stop.cancel()
        both.join(15)
    assert outcome == ["cancelled"]
    assert (shared.stats().queued, busy.stats().queued) == (0, 0)


def test_a_request_lacking_room_only_in_one_limiter_is_served_at_its_place_there(
    make_limiter: MakeLimiter,
) -> None:
    shared = make_limiter(max_concurrent=1)
    busy = make_limiter(max_concurrent=1)
    order: list[str] = []
    lock = threading.Lock()

    def take(name: str, *limiters: PostgresConcurrencyLimiter) -> None:
        with slot(*limiters):
            with lock:
                order.append(name)
            time.sleep(0.02)

    held_shared = slot(shared)
    held_shared.__enter__()
    with slot(busy):
        both = threading.Thread(target=take, args=("both", shared, busy))
        both.start()
        wait_for(lambda: shared.stats().queued == 1, "the request over both queued")
        later = [threading.Thread(target=take, args=(f"s{i}", shared)) for i in range(3)]
        for thread in later:
            thread.start()
        wait_for(lambda: shared.stats().queued == 4, "the later ones queued")
    # `busy` is free: the request over both lacks room only in `shared`, where it keeps
    # its place (first in line): `shared`'s next slot is its, not a later one's.
    time.sleep(0.1)
    assert order == []
    held_shared.__exit__(None, None, None)
    for thread in [both, *later]:
        thread.join(15)
    assert order[0] == "both"
    assert sorted(order[1:]) == ["s0", "s1", "s2"]


def test_a_request_over_several_times_out_holding_nothing(make_limiter: MakeLimiter) -> None:
    a = make_limiter(max_concurrent=1)
    b = make_limiter(max_concurrent=1, workloads={"default": {"max_wait_ms": 200}})
    with slot(b):
        started = time.monotonic()
        with pytest.raises(ConcurrencyTimeoutError), slot(a, b):
            pass  # pragma: no cover - never entered
        assert time.monotonic() - started < 5
        assert (a.stats().active, a.stats().queued, b.stats().queued) == (0, 0, 0)
    with slot(a, b):
        pass


def test_limiters_of_two_databases_cannot_be_held_together(pg_dsn: str, fresh_dsn: str) -> None:
    here = create_postgres_concurrency_limiter(pg_dsn, name=unique_name(), max_concurrent=1)
    there = create_postgres_concurrency_limiter(fresh_dsn, name=unique_name(), max_concurrent=1)
    with pytest.raises(ConcurrencyConfigError, match="cannot be held together"), slot(here, there):
        pass  # pragma: no cover - never entered


def test_a_tenants_second_call_waiting_first_in_line_does_not_hold_up_another_tenant(
    make_limiter: MakeLimiter,
) -> None:
    # Provider at 3, a limit of 1 per tenant. acme's second call waits for acme (where
    # it lacks room in acme, so it holds nothing in the provider); globex has room in the
    # provider and in its own key, and gets its slots at once.
    provider = make_limiter(max_concurrent=3)
    tenants = make_limiter(max_concurrent=1, keyed=True)
    acme, globex = tenants.key("acme"), tenants.key("globex")
    release = threading.Event()

    def first() -> None:
        with slot(provider, acme):
            release.wait(15)

    def second() -> None:
        with slot(provider, acme):
            pass

    threads = [threading.Thread(target=first)]
    threads[0].start()
    wait_for(lambda: provider.stats().active == 1, "acme's first call holds its slots")
    threads.append(threading.Thread(target=second))
    threads[1].start()
    wait_for(lambda: acme.stats().queued == 1, "acme's second call waits")
    try:
        with run(timeout_ms=500), slot(provider, globex):
            assert provider.stats().active == 2
    finally:
        release.set()
        for thread in threads:
            thread.join(15)


# -- faults -------------------------------------------------------------------------------

ACQUIRE_SEVERAL = b"runcell_acquire("


@pytest.fixture
def dropper(pg_dsn: str) -> Iterator[ReplyDropper]:
    params = psycopg.conninfo.conninfo_to_dict(pg_dsn)
    with ReplyDropper(
        (str(params.get("host") or "127.0.0.1"), int(params.get("port") or 5432))
    ) as proxy:
        yield proxy


def _via(proxy: ReplyDropper, dsn: str) -> str:
    params = psycopg.conninfo.conninfo_to_dict(dsn)
    params.update(host="127.0.0.1", port=str(proxy.port))
    return psycopg.conninfo.make_conninfo(**params)


def _pairs(
    pg_dsn: str, proxy: ReplyDropper, **options: Any
) -> tuple[list[PostgresConcurrencyLimiter], list[PostgresConcurrencyLimiter]]:
    """Two limiters, each twice: through the proxy, and direct."""
    names = [unique_name("lost-reply-a"), unique_name("lost-reply-b")]
    direct = [create_postgres_concurrency_limiter(pg_dsn, name=n, max_concurrent=1) for n in names]
    proxied = [
        create_postgres_concurrency_limiter(
            _via(proxy, pg_dsn),
            name=n,
            max_concurrent=1,
            listen=False,
            poll_interval_ms=20,
            **options,
        )
        for n in names
    ]
    return proxied, direct


def test_a_lost_reply_to_a_grant_over_several_limiters_gives_the_leases_to_the_retry(
    pg_dsn: str, dropper: ReplyDropper
) -> None:
    (a, b), (direct_a, direct_b) = _pairs(pg_dsn, dropper)
    dropper.arm(ACQUIRE_SEVERAL)
    with run(timeout_ms=10_000), slot(a, b) as held:
        assert dropper.dropped[ACQUIRE_SEVERAL] == 1, "no reply was lost; proves nothing"
        # The retry found the leases its first attempt took: one slot each, no more.
        assert (direct_a.stats().active, direct_b.stats().active) == (1, 1)
        assert {lease.limiter for lease in held.leases} == {a.name, b.name}
    assert (direct_a.stats().active, direct_b.stats().active) == (0, 0)


@pytest.mark.stress  # waits out a queue entry TTL (about 15 s); CI runs the stress suite
def test_a_lost_reply_to_a_queued_request_over_several_limiters_keeps_one_place(
    pg_dsn: str, dropper: ReplyDropper
) -> None:
    (a, b), (direct_a, direct_b) = _pairs(pg_dsn, dropper)
    granted: list[bool] = []

    def wait_for_both() -> None:
        with run(timeout_ms=15_000), slot(a, b):
            granted.append(True)

    with slot(direct_b):
        dropper.arm(ACQUIRE_SEVERAL)
        waiting = threading.Thread(target=wait_for_both)
        waiting.start()
        wait_for(lambda: dropper.dropped[ACQUIRE_SEVERAL] == 1, "the queued reply was lost")
        wait_for(lambda: direct_b.stats().queued == 1, "the request queued")
        time.sleep(0.3)  # the retry has had its answer
        assert (direct_a.stats().queued, direct_b.stats().queued) == (1, 1)
    waiting.join(15)
    assert granted == [True]
    assert (direct_a.stats().queued, direct_b.stats().queued) == (0, 0)


def test_several_limiters_fail_closed_while_the_database_is_unreachable(
    pg_dsn: str, dropper: ReplyDropper
) -> None:
    (a, b), (direct_a, direct_b) = _pairs(pg_dsn, dropper, connect_timeout_ms=500)
    with slot(a, b):
        pass  # the pool's connections are open
    dropper.cut()  # every connection through the proxy dies, and new ones are refused
    try:
        # Without a budget it fails closed once no connection could be had (with one,
        # it would keep trying while the budget lasts, as one limiter does).
        with pytest.raises(ConcurrencyLimiterError), slot(a, b):
            pass  # pragma: no cover - never entered: no slot without the database
    finally:
        dropper.restore()
    assert (direct_a.stats().active, direct_b.stats().active) == (0, 0)
    with run(timeout_ms=10_000), slot(a, b):  # it recovers on its own
        assert (direct_a.stats().active, direct_b.stats().active) == (1, 1)


def test_a_young_request_over_two_limiters_holds_no_room_and_is_granted_within_its_bound(
    pg_dsn: str,
) -> None:
    """The waiting rule on PostgreSQL (its SQL side is the schema's): ``[a, b]`` waits
    on ``b``; ``a`` alone is granted at once; then with three threads churning ``a`` and
    ``b`` freed, ``[a, b]`` is granted within GROUP_AGEING_MS + one hold of ``a``."""

    def create(**options: Any) -> PostgresConcurrencyLimiter:
        return create_postgres_concurrency_limiter(pg_dsn, name=unique_name("ageing"), **options)

    cases = {case.name: case for case in members_conformance_cases(create)}
    cases["a_young_request_over_many_limiters_holds_no_room_and_ages_within_its_bound"].run()
