"""Parked requests in PostgreSQL: their place, their grants, their re-publication."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import psycopg

from runcell_celery import AcquireRequest, Lease, RunLineage
from runcell_celery.ports import Parked, Republish
from runcell_celery.postgres import PostgresBackend
from runcell_celery.protocol import Member
from tests.support.pg import unique_name

PAYLOAD = '{"task": "demo.summarize", "args": [42]}'


def _request(request_id: str, *, in_progress: bool = False) -> AcquireRequest:
    return AcquireRequest(
        request_id=request_id,
        workload="default",
        lineage=RunLineage(request_id, request_id),
        in_progress=in_progress,
    )


def _queue(dsn: str, name: str) -> list[tuple[str, bool, bool]]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT request_id, parked, granted_lease_id IS NOT NULL FROM runcell_queue "
            "WHERE limiter = %s ORDER BY position",
            [name],
        ).fetchall()
    return [(r[0], r[1], r[2]) for r in rows]


def test_parked_requests_keep_their_place_and_their_grant_is_published_once(
    make_limiter, pg_dsn: str
) -> None:
    limiter = make_limiter(max_concurrent=1)
    held = limiter.acquire(_request(unique_name("holder")))
    first, second = unique_name("first"), unique_name("second")
    assert isinstance(
        limiter.acquire_or_park(
            [Member(limiter, _request(first))], admission_wait_ms=0, payload=PAYLOAD
        ),
        Parked,
    )
    assert isinstance(
        limiter.acquire_or_park(
            [Member(limiter, _request(second))], admission_wait_ms=0, payload=PAYLOAD
        ),
        Parked,
    )
    assert _queue(pg_dsn, limiter.name) == [(first, True, False), (second, True, False)]

    limiter.release(held)  # the freed slot goes to the oldest parked request ...
    assert _queue(pg_dsn, limiter.name) == [(first, True, True), (second, True, False)]
    stats = limiter.stats()
    assert (stats.active, stats.queued) == (1, 1)

    backend = PostgresBackend(database=pg_dsn)

    def mine(claims: list[Republish]) -> list[Republish]:  # others' grants may be left
        return [c for c in claims if c.limiter == limiter.name]

    (claim,) = mine(backend.claim_republish(stale_ms=0))  # ... to be published exactly once
    assert claim.request_id == first
    assert json.loads(claim.payload) == json.loads(PAYLOAD)
    assert mine(backend.claim_republish(stale_ms=0)) == []

    # Another publication's copy: the request is still stored for its own publication.
    assert limiter.claim_parked([limiter], first, "00000000-0000-0000-0000-000000000000") == "stale"
    (lease,) = limiter.claim_parked([limiter], first, claim.publication_id)
    assert isinstance(lease, Lease)
    assert limiter.claim_parked([limiter], first, claim.publication_id) == "missing", (
        "claimed twice"
    )
    assert _queue(pg_dsn, limiter.name) == [(second, True, False)]
    limiter.release(lease)
    assert _queue(pg_dsn, limiter.name) == [(second, True, True)]


def test_a_grant_nobody_picks_up_passes_on_and_the_request_waits_at_the_back(
    make_limiter, pg_dsn: str
) -> None:
    limiter = make_limiter(max_concurrent=1, lease_ttl_ms=300)
    held = limiter.acquire(_request(unique_name("holder")))
    first, second = unique_name("first"), unique_name("second")
    limiter.acquire_or_park(
        [Member(limiter, _request(first))], admission_wait_ms=0, payload=PAYLOAD
    )
    limiter.acquire_or_park(
        [Member(limiter, _request(second))], admission_wait_ms=0, payload=PAYLOAD
    )
    limiter.release(held)
    assert _queue(pg_dsn, limiter.name)[0] == (first, True, True)
    time.sleep(0.5)  # the grant's claim window (the 300 ms TTL) ends: its task never started
    limiter.reap()
    # The slot goes to the next in line; the unclaimed request waits behind it.
    assert _queue(pg_dsn, limiter.name) == [(second, True, True), (first, True, False)]


def test_a_run_in_progress_goes_before_parked_requests_that_queued_earlier(
    make_limiter, pg_dsn: str
) -> None:
    limiter = make_limiter(max_concurrent=1)
    held = limiter.acquire(_request(unique_name("holder")))
    parked = unique_name("parked")
    limiter.acquire_or_park(
        [Member(limiter, _request(parked))], admission_wait_ms=0, payload=PAYLOAD
    )
    queued = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        # A running agent's second call: its task holds a worker process.
        second_call = pool.submit(
            limiter.acquire,
            _request(unique_name("second-call"), in_progress=True),
            on_wait=lambda _deadline: queued.set(),
        )
        assert queued.wait(10)
        limiter.release(held)
        lease = second_call.result(10)
    assert _queue(pg_dsn, limiter.name) == [(parked, True, False)], "the parked one jumped in"
    limiter.release(lease)
    assert _queue(pg_dsn, limiter.name) == [(parked, True, True)]


def test_another_delivery_of_a_parked_request_parks_it_again_without_error(
    make_limiter, pg_dsn: str
) -> None:
    limiter = make_limiter(max_concurrent=1)
    held = limiter.acquire(_request(unique_name("holder")))
    request = _request(unique_name("redelivered"))
    assert isinstance(
        limiter.acquire_or_park([Member(limiter, request)], admission_wait_ms=0, payload=PAYLOAD),
        Parked,
    )
    # The same task delivered again (its message was redelivered): it waits a moment on
    # the parked row it already has, polling it, then leaves it parked.
    assert isinstance(
        limiter.acquire_or_park([Member(limiter, request)], admission_wait_ms=300, payload=PAYLOAD),
        Parked,
    )
    assert _queue(pg_dsn, limiter.name) == [(request.request_id, True, False)]
    limiter.release(held)


def test_a_stale_parked_request_stays_stored_until_its_failure_is_completed(
    make_limiter, pg_dsn: str
) -> None:
    limiter = make_limiter(max_concurrent=1)
    held = limiter.acquire(_request(unique_name("holder")))
    stale = unique_name("stale")
    request = AcquireRequest(stale, "default", RunLineage(stale, stale), timeout_ms=50)
    assert isinstance(
        limiter.acquire_or_park([Member(limiter, request)], admission_wait_ms=0, payload=PAYLOAD),
        Parked,
    )
    time.sleep(0.1)  # its deadline passes while it is parked
    taker, other = PostgresBackend(database=pg_dsn), PostgresBackend(database=pg_dsn)

    def taken(backend: PostgresBackend) -> list[str]:
        return [e.request_id for e in backend.take_expired_parked() if e.limiter == limiter.name]

    assert taken(taker) == [stale]
    assert limiter.stats().queued == 0, "a stale request still counts as waiting"
    assert _queue(pg_dsn, limiter.name) == [(stale, False, False)], "deleted before completion"
    assert taken(other) == [], "handed to a second taker while the first may record it"
    assert taken(taker) == [stale], "not handed again to its taker, which must retry"

    (expired,) = [e for e in taker.take_expired_parked() if e.limiter == limiter.name]
    assert taker.complete_expired_parked([expired]) == 1
    assert _queue(pg_dsn, limiter.name) == []
    assert taken(taker) == []
    limiter.release(held)


def test_a_claimed_parked_lease_is_never_withdrawn_by_its_request_id(
    make_limiter, pg_dsn: str
) -> None:
    limiter = make_limiter(max_concurrent=1)
    held = limiter.acquire(_request(unique_name("holder")))
    parked = unique_name("parked")
    assert isinstance(
        limiter.acquire_or_park(
            [Member(limiter, _request(parked))], admission_wait_ms=0, payload=PAYLOAD
        ),
        Parked,
    )
    limiter.release(held)
    backend = PostgresBackend(database=pg_dsn)
    (claim,) = [c for c in backend.claim_republish(stale_ms=0) if c.limiter == limiter.name]
    (lease,) = limiter.claim_parked([limiter], parked, claim.publication_id)
    assert isinstance(lease, Lease)

    # Another copy of the same message gives up "its" place: the running delivery's
    # lease is not its to give back.
    limiter.withdraw_members([limiter], parked)

    assert limiter.renew(lease) is not None, "the running delivery lost its lease"
    assert limiter.stats().active == 1
    limiter.release(lease)
