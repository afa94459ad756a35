"""Parked tasks of several brokers in one limiter database: each goes back to its own."""

from __future__ import annotations

import time

import psycopg

from runcell_celery import AcquireRequest, RunLineage
from runcell_celery.ports import Parked
from runcell_celery.postgres import PostgresBackend
from runcell_celery.protocol import Member
from tests.support.pg import unique_name

PAYLOAD = '{"task": "demo.summarize", "args": [42]}'


def _request(request_id: str, *, timeout_ms: float | None = None) -> AcquireRequest:
    return AcquireRequest(
        request_id, "default", RunLineage(request_id, request_id), timeout_ms=timeout_ms
    )


def _brokers(dsn: str, name: str) -> dict[str, str | None]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT request_id, broker FROM runcell_queue WHERE limiter = %s", [name]
        ).fetchall()
    return {r[0]: r[1] for r in rows}


def test_a_granted_parked_task_is_republished_only_by_a_publisher_of_its_broker(
    make_limiter, pg_dsn: str
) -> None:
    limiter = make_limiter(max_concurrent=3)
    holders = [limiter.acquire(_request(unique_name("holder"))) for _ in range(3)]
    broker_a, broker_b = unique_name("redis:a"), unique_name("redis:b")
    of_a, of_b, legacy = unique_name("of-a"), unique_name("of-b"), unique_name("legacy")
    for request_id, broker in ((of_a, broker_a), (of_b, broker_b), (legacy, None)):
        parked = limiter.acquire_or_park(
            [Member(limiter, _request(request_id))],
            admission_wait_ms=0,
            payload=PAYLOAD,
            broker=broker,
        )
        assert isinstance(parked, Parked)
    assert _brokers(pg_dsn, limiter.name) == {of_a: broker_a, of_b: broker_b, legacy: None}
    for lease in holders:
        limiter.release(lease)  # all three parked requests are granted

    backend = PostgresBackend(database=pg_dsn)

    def claim(broker: str, others: set[str]) -> set[str]:
        claims = backend.claim_republish(stale_ms=0, broker=broker, others=others)
        return {c.request_id for c in claims if c.limiter == limiter.name}

    seen_by_b: set[str] = set()
    # B's publisher takes its own grant and the one parked before brokers were recorded,
    # and leaves A's, naming A's broker as the one it left.
    assert claim(broker_b, seen_by_b) == {of_b, legacy}
    assert broker_a in seen_by_b
    assert broker_b not in seen_by_b
    assert claim(broker_b, seen_by_b) == set(), "another broker's grant taken on a second pass"

    seen_by_a: set[str] = set()
    assert claim(broker_a, seen_by_a) == {of_a}
    assert broker_a not in seen_by_a
    assert broker_b not in seen_by_a, "a published grant still reads as left to another broker"


def test_a_parked_task_past_its_deadline_is_failed_only_by_a_worker_of_its_broker(
    make_limiter, pg_dsn: str
) -> None:
    limiter = make_limiter(max_concurrent=1)
    held = limiter.acquire(_request(unique_name("holder")))
    broker_a, broker_b = unique_name("redis:a"), unique_name("redis:b")
    stale = unique_name("stale")
    parked = limiter.acquire_or_park(
        [Member(limiter, _request(stale, timeout_ms=50))],
        admission_wait_ms=0,
        payload=PAYLOAD,
        broker=broker_a,
    )
    assert isinstance(parked, Parked)
    time.sleep(0.1)  # its deadline passes while it is parked
    backend = PostgresBackend(database=pg_dsn)

    def taken(broker: str) -> list[str]:
        expired = backend.take_expired_parked(broker=broker)
        return [e.request_id for e in expired if e.limiter == limiter.name]

    assert taken(broker_b) == [], "failed in another broker's result backend"
    assert limiter.stats().queued == 1
    (expired,) = [e for e in backend.take_expired_parked(broker=broker_a) if e.request_id == stale]
    assert backend.complete_expired_parked([expired]) == 1
    assert _brokers(pg_dsn, limiter.name) == {}
    limiter.release(held)
