"""Wake-ups by LISTEN/NOTIFY, batched renewal, and fencing tokens under concurrency."""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psycopg
import pytest

from runcell_celery import AcquireRequest, ConcurrencyError, Lease, RunLineage, slot
from runcell_celery.ports import Parked
from runcell_celery.postgres import create_postgres_concurrency_limiter
from runcell_celery.postgres.connection import Database
from runcell_celery.postgres.listener import GrantListener
from runcell_celery.protocol import Member
from tests.support.pg import unique_name

SOON_S = 15.0


def _wait_listening(limiter: Any) -> None:
    deadline = time.monotonic() + SOON_S
    while limiter.listening is not True:
        assert limiter.listening is not False, "the listener's self-check failed"
        assert time.monotonic() < deadline, "the listener never became ready"
        time.sleep(0.01)


def _released_to_a_waiter(limiter: Any, *, settle_s: float = 0.0) -> bool:
    """Hold the only slot while another thread queues for it, then release it; return
    whether the waiter got the slot soon after (``settle_s``: how long to keep holding
    once it queued)."""
    granted = threading.Event()

    def wait_for_the_slot() -> None:
        with slot(limiter):
            granted.set()

    with slot(limiter):
        waiter = threading.Thread(target=wait_for_the_slot)
        waiter.start()
        deadline = time.monotonic() + SOON_S
        while limiter.stats().queued == 0:
            assert time.monotonic() < deadline, "the waiter never queued"
            time.sleep(0.01)
        time.sleep(settle_s)
    served = granted.wait(SOON_S)
    waiter.join(SOON_S)
    return served


def test_a_release_wakes_the_granted_waiter_long_before_its_next_poll(pg_dsn: str) -> None:
    # Polling once a minute: only a notification can serve the waiter within the join.
    limiter = create_postgres_concurrency_limiter(
        pg_dsn, name=unique_name("notify"), max_concurrent=1, poll_interval_ms=60_000
    )
    _wait_listening(limiter)
    assert _released_to_a_waiter(limiter), "the release did not wake the waiter"


def test_a_release_wakes_a_waiter_of_its_own_process_without_any_notification(
    pg_dsn: str,
) -> None:
    # No listener and a poll once a minute: only the release's own answer can serve the
    # waiter within the join (the releasing process wakes its own waiters at once).
    limiter = create_postgres_concurrency_limiter(
        pg_dsn,
        name=unique_name("local"),
        max_concurrent=1,
        listen=False,
        poll_interval_ms=60_000,
    )
    # The safety poll ran once when the waiter queued; the next is a minute away.
    assert _released_to_a_waiter(limiter, settle_s=0.3), (
        "the release did not hand the slot to its own process's waiter"
    )


def test_joining_the_queue_commits_asynchronously_and_a_grant_synchronously(
    pg_dsn: str,
) -> None:
    # The engine's functions decide this themselves (SET LOCAL synchronous_commit):
    # read back what each transaction left as its setting, inside the transaction.
    limiter = create_postgres_concurrency_limiter(
        pg_dsn, name=unique_name("commits"), max_concurrent=1
    )
    name = limiter.name
    with slot(limiter), psycopg.connect(pg_dsn) as conn:
        config_hash = conn.execute(
            "SELECT config_hash FROM runcell_limiter WHERE name = %s", [name]
        ).fetchone()
        assert config_hash is not None
        process = (
            '{"process_id": "p-commits", "channel": "runcell_w_commits", "host": "h", '
            '"pid": 1, "ttl_ms": 30000}'
        )
        request = (
            '{"request_id": "r-commits", "workload": "default", "run_id": "r-commits", '
            '"root_run_id": "r-commits", "parent_run_id": null, "holder_name": "t", '
            '"in_progress": false}'
        )
        answer = conn.execute(
            "SELECT runcell_acquire(ARRAY[%s::text], ARRAY[%s::text], NULL, %s::jsonb, NULL, "
            "%s::jsonb, 5000, false)",
            [name, config_hash[0], request, process],
        ).fetchone()
        assert answer is not None
        assert answer[0]["s"] == "queued"
        setting = conn.execute("SELECT current_setting('synchronous_commit')").fetchone()
        conn.rollback()
        assert setting == ("off",), "a request that only joins the queue commits asynchronously"
        granting = conn.execute("SELECT lease_id FROM runcell_lease WHERE limiter = %s", [name])
        held = granting.fetchone()
        assert held is not None
        # Queue a waiter for real, then release in a transaction of our own: it grants.
        conn.execute(
            "SELECT runcell_acquire(ARRAY[%s::text], ARRAY[%s::text], NULL, %s::jsonb, NULL, "
            "%s::jsonb, 5000, false)",
            [name, config_hash[0], request, process],
        )
        conn.commit()
        released = conn.execute("SELECT runcell_release(%s, %s, 5000)", [name, held[0]]).fetchone()
        setting = conn.execute("SELECT current_setting('synchronous_commit')").fetchone()
        conn.rollback()
    assert released is not None
    assert [g[0] for g in released[0]["g"]] == ["r-commits"]
    assert setting == ("on",), "a release that grants commits synchronously"


class _CountingConnection(psycopg.Connection[Any]):
    """Records every ``execute`` sent through the connection (not a mock: it runs them)."""

    sent: list[tuple[str, Any]] = []

    def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:  # type: ignore[override]
        _CountingConnection.sent.append((str(query), params))
        return super().execute(query, params, **kwargs)


def test_renewing_every_lease_a_process_holds_is_one_statement(pg_dsn: str) -> None:
    limiter = create_postgres_concurrency_limiter(
        pg_dsn, name=unique_name("renew"), max_concurrent=4, lease_ttl_ms=1500
    )
    seen: list[set[object]] = []
    with (
        psycopg.connect(pg_dsn, autocommit=True) as conn,
        slot(limiter),
        slot(limiter),
        slot(limiter),
        slot(limiter),
    ):
        stop = time.monotonic() + 3.0  # about six renewal periods (a third of the TTL)
        while time.monotonic() < stop:
            rows = conn.execute(
                "SELECT renewed_at FROM runcell_lease WHERE limiter = %s", [limiter.name]
            ).fetchall()
            assert len(rows) == 4, "a held lease expired"
            seen.append({row[0] for row in rows})
            time.sleep(0.05)
    renewal_instants = set().union(*seen)
    assert len(renewal_instants) >= 4, "the keeper did not renew"
    # One statement renews all four each period: they always share one instant
    # (the statement's), apart from the moments the four were first granted.
    assert sum(len(instants) > 1 for instants in seen[len(seen) // 4 :]) == 0, seen


def test_fencing_tokens_are_unique_and_increase_for_every_holder(pg_dsn: str) -> None:
    limiter = create_postgres_concurrency_limiter(
        pg_dsn, name=unique_name("fencing"), max_concurrent=3, poll_interval_ms=10
    )

    def use(n: int) -> list[int]:
        tokens = []
        for _ in range(n):
            with slot(limiter) as held:
                assert held.fencing_token is not None
                tokens.append(held.fencing_token)
        return tokens

    with ThreadPoolExecutor(6) as pool:
        per_thread = list(pool.map(use, [20] * 6))
    every = [token for tokens in per_thread for token in tokens]
    assert len(set(every)) == len(every) == 120
    for tokens in per_thread:
        assert tokens == sorted(tokens), "a holder saw its fencing token go backwards"


def _listening_sessions(dsn: str) -> int:
    """Sessions listening on this test's channel (other tests' backends may be closing
    theirs meanwhile, as they are collected)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND query LIKE 'LISTEN %%runcell_w_test%%'"
        ).fetchone()
    assert row is not None
    return int(row[0])


def test_a_stopped_listener_ends_its_thread_and_closes_its_connection(pg_dsn: str) -> None:
    before = _listening_sessions(pg_dsn)
    heard: list[str] = []
    listener = GrantListener(
        Database(pg_dsn), "runcell_w_test", on_grants=heard.append, on_connect=lambda: None
    )
    listener.start()
    assert listener.connected.wait(SOON_S), "the listener never connected"
    assert listener.available is True
    assert _listening_sessions(pg_dsn) == before + 1

    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_notify('runcell_w_test', %s)", ['{"g": []}'])
    deadline = time.monotonic() + SOON_S
    while not heard and time.monotonic() < deadline:
        time.sleep(0.01)
    assert heard == ['{"g": []}'], "the process's channel was not heard"

    listener.stop()
    assert not listener.connected.is_set()
    assert _listening_sessions(pg_dsn) == before


def test_a_waiter_keeps_its_budget_when_this_hosts_clock_is_far_from_the_databases(
    pg_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # This host's wall clock runs an hour ahead of the database's. A waiter whose
    # queue row was reaped (its process stalled) takes a new place with the time it
    # has left: measured on the monotonic clock from the database's duration, never
    # by comparing the database's deadline with this host's time.
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + 3600)
    limiter = create_postgres_concurrency_limiter(
        pg_dsn, name=unique_name("skew"), max_concurrent=1, poll_interval_ms=20, listen=False
    )
    holder = _request()
    held = limiter.acquire(holder)
    waiter_request = AcquireRequest(
        request_id=unique_name("waiter"),
        workload="default",
        lineage=RunLineage("skewed-run", "skewed-run"),
        timeout_ms=30_000,
    )
    outcome: list[object] = []

    def wait() -> None:
        try:
            outcome.append(limiter.acquire(waiter_request))
        except ConcurrencyError as exc:
            outcome.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        _wait_for_row(conn, waiter_request.request_id)
        conn.execute("DELETE FROM runcell_queue WHERE request_id = %s", [waiter_request.request_id])
        _wait_for_row(conn, waiter_request.request_id)  # back in line, with its budget
    limiter.release(held)
    waiter.join(SOON_S)
    assert len(outcome) == 1
    assert isinstance(outcome[0], Lease), f"the waiter failed: {outcome[0]!r}"
    limiter.release(outcome[0])


def _request() -> AcquireRequest:
    request_id = unique_name("request")
    return AcquireRequest(request_id, "default", RunLineage(request_id, request_id))


def _wait_for_row(conn: psycopg.Connection[Any], request_id: str) -> None:
    deadline = time.monotonic() + SOON_S
    while not conn.execute(
        "SELECT 1 FROM runcell_queue WHERE request_id = %s", [request_id]
    ).fetchone():
        assert time.monotonic() < deadline, f"{request_id} never queued"
        time.sleep(0.005)


def test_a_parked_grant_made_by_the_safety_polls_reap_is_republished_at_once(
    pg_dsn: str,
) -> None:
    # A holder that died (its lease is never renewed) holds the only slot; a parked
    # request and a waiting one stand in line. When the lease expires, the waiting
    # process's safety poll reaps it and the parked request is granted: its task must be
    # re-published by that pass, not seconds later by a sweeper (none runs here).
    limiter = create_postgres_concurrency_limiter(
        pg_dsn, name=unique_name("reap-parked"), max_concurrent=1, lease_ttl_ms=1000
    )
    published: list[list[str]] = []
    announced = threading.Event()

    def republish(lease_ids: list[str]) -> None:
        published.append(lease_ids)
        announced.set()

    limiter.set_parked_granted_handler(republish)

    def request(request_id: str) -> AcquireRequest:
        return AcquireRequest(
            request_id=request_id,
            workload="default",
            lineage=RunLineage(request_id, request_id),
            timeout_ms=3_000,
        )

    limiter.acquire(request(unique_name("dead-holder")))  # never renewed: expires in 1 s
    parked = limiter.acquire_or_park(
        [Member(limiter, request(unique_name("parked")))],
        admission_wait_ms=0,
        payload='{"task": "t"}',
    )
    assert isinstance(parked, Parked)

    # Only there so that this process waits on the limiter (and its safety poll looks
    # at it); what becomes of it is not this test's concern.
    def wait() -> None:
        with contextlib.suppress(ConcurrencyError):
            limiter.acquire(request(unique_name("waiter")))

    waiter = threading.Thread(target=wait)
    waiter.start()
    try:
        assert announced.wait(SOON_S), "the parked grant was never re-published"
        assert len(published[0]) == 1
    finally:
        waiter.join(SOON_S)
