"""A parked request's claim answers its whole wait, from its first ask to the claim.

The re-published delivery that claims a parked grant asked for nothing itself: what it
measures is the claim's round trip. The wait that counts runs from the first
delivery's ask (the queue row's ``enqueued_at``, kept while the request is parked, is
granted, and goes back in line after an unclaimed grant) to the claim, in database
time, so every process that reads it (events, admin, metrics) gets the same figure.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable

import psycopg
import pytest

from runcell_celery import AcquireRequest, Lease, RunLineage
from runcell_celery.ports import Parked
from runcell_celery.postgres import PostgresBackend, PostgresConcurrencyLimiter
from runcell_celery.protocol import Member
from tests.support.pg import unique_name

MakeLimiter = Callable[..., PostgresConcurrencyLimiter]
PAYLOAD = '{"task": "demo.summarize", "args": [42]}'
#: How long the parked request stays in line before its slot frees.
PARKED_S = 0.4


def _request(request_id: str) -> AcquireRequest:
    return AcquireRequest(
        request_id=request_id, workload="default", lineage=RunLineage(request_id, request_id)
    )


def _asked_at(dsn: str, request_id: str) -> datetime.datetime:
    """The queue row's first ask (``enqueued_at``), read from the database."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT min(enqueued_at) FROM runcell_queue WHERE request_id = %s OR group_id = %s",
            [request_id, request_id],
        ).fetchone()
    assert row is not None
    assert row[0] is not None
    return row[0]


def _picked_up_at(dsn: str, lease: Lease) -> datetime.datetime:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT picked_up_at FROM runcell_lease WHERE lease_id = %s", [lease.lease_id]
        ).fetchone()
    assert row is not None
    assert row[0] is not None
    return row[0]


def _ms(delta: datetime.timedelta) -> float:
    return delta.total_seconds() * 1000


def _publication(backend: PostgresBackend, request_id: str) -> str:
    (claim,) = [c for c in backend.claim_republish(stale_ms=0) if c.request_id == request_id]
    return claim.publication_id


def test_a_claimed_parked_grant_carries_the_wait_since_the_request_first_asked(
    make_limiter: MakeLimiter, pg_dsn: str
) -> None:
    limiter = make_limiter(max_concurrent=1)
    held = limiter.acquire(_request(unique_name("holder")))
    parked_id = unique_name("parked")
    asked = time.monotonic()
    assert isinstance(
        limiter.acquire_or_park(
            [Member(limiter, _request(parked_id))], admission_wait_ms=0, payload=PAYLOAD
        ),
        Parked,
    )
    first_ask = _asked_at(pg_dsn, parked_id)
    time.sleep(PARKED_S)
    limiter.release(held)  # granted to the parked request, published ...
    backend = PostgresBackend(database=pg_dsn)
    try:
        publication = _publication(backend, parked_id)
    finally:
        backend.close()

    (lease,) = limiter.claim_parked(
        [limiter], parked_id, publication
    )  # ... and claimed by its copy
    elapsed_ms = (time.monotonic() - asked) * 1000

    assert isinstance(lease, Lease)
    assert lease.waited_ms is not None, "the claim does not say how long the request waited"
    # The database's own figure: from the row's first ask to the claim's pick-up.
    assert lease.waited_ms == pytest.approx(_ms(_picked_up_at(pg_dsn, lease) - first_ask), abs=1)
    assert PARKED_S * 1000 <= lease.waited_ms <= elapsed_ms + 50
    limiter.release(lease)


def test_a_parked_request_s_wait_keeps_its_first_ask_after_an_unclaimed_grant(
    make_limiter: MakeLimiter, pg_dsn: str
) -> None:
    limiter = make_limiter(max_concurrent=1, lease_ttl_ms=300)
    held = limiter.acquire(_request(unique_name("holder")))
    parked_id = unique_name("parked")
    limiter.acquire_or_park(
        [Member(limiter, _request(parked_id))], admission_wait_ms=0, payload=PAYLOAD
    )
    first_ask = _asked_at(pg_dsn, parked_id)
    limiter.release(held)  # granted, but its task never claims it ...
    time.sleep(0.5)
    limiter.reap()  # ... so the grant passes on and the request is back in line
    assert _asked_at(pg_dsn, parked_id) == first_ask, "going back in line reset the first ask"

    backend = PostgresBackend(database=pg_dsn)
    try:
        limiter.reap()  # nothing else in line: granted to it again
        (lease,) = limiter.claim_parked([limiter], parked_id, _publication(backend, parked_id))
    finally:
        backend.close()
    assert isinstance(lease, Lease)
    assert lease.waited_ms == pytest.approx(_ms(_picked_up_at(pg_dsn, lease) - first_ask), abs=1)
    assert lease.waited_ms >= 500
    limiter.release(lease)


def test_leases_claimed_together_over_several_limiters_carry_the_request_s_whole_wait(
    make_limiter: MakeLimiter, pg_dsn: str
) -> None:
    a = make_limiter(max_concurrent=1)
    b = make_limiter(max_concurrent=1)
    held = b.acquire(_request(unique_name("holder")))
    group = unique_name("parked")
    parked = a.acquire_or_park(
        [Member(a, _request(group)), Member(b, _request(group))],
        admission_wait_ms=0,
        payload=PAYLOAD,
    )
    assert isinstance(parked, Parked)
    first_ask = _asked_at(pg_dsn, group)
    time.sleep(PARKED_S)
    b.release(held)
    backend = PostgresBackend(database=pg_dsn)
    try:
        (claim,) = [
            c for c in backend.claim_republish(stale_ms=0) if c.request_id.startswith(f"{group}|")
        ]
    finally:
        backend.close()

    leases = a.claim_parked([a, b], group, claim.publication_id)

    assert isinstance(leases, tuple)
    expected = _ms(_picked_up_at(pg_dsn, leases[0]) - first_ask)
    for lease in leases:
        assert lease.waited_ms == pytest.approx(expected, abs=1)
        assert lease.waited_ms >= PARKED_S * 1000
    for limiter, lease in zip([a, b], leases, strict=True):
        limiter.release(lease)
