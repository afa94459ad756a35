"""The claim window: a grant to a parked request is held only briefly for its task.

A slot granted to a parked request waits ``claim_window_ms`` for the re-published task
to claim it. Unclaimed by then, its lease ends, the slot goes to the next in line, and
the parked request goes to the back of its workload's line, to be granted (and
re-published) again when its turn comes. A claim in time holds the slot for the full
lease TTL.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import psycopg
import pytest

from runcell_celery import (
    AcquireRequest,
    ConcurrencyConfigError,
    Lease,
    LimiterConfig,
    RunLineage,
)
from runcell_celery.ports import Parked
from runcell_celery.postgres import (
    PostgresBackend,
    PostgresConcurrencyLimiter,
    create_postgres_concurrency_limiter,
)
from runcell_celery.protocol import Member
from tests.support.pg import unique_name

PAYLOAD = '{"task": "demo.summarize", "args": [42]}'
CLAIM_WINDOW_MS = 1_000


def _request(request_id: str) -> AcquireRequest:
    return AcquireRequest(
        request_id=request_id, workload="default", lineage=RunLineage(request_id, request_id)
    )


def _queue(dsn: str, name: str) -> list[tuple[str, bool, bool]]:
    """(request id, parked, granted) of each queue row, in line order."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT request_id, parked, granted_lease_id IS NOT NULL FROM runcell_queue "
            "WHERE limiter = %s ORDER BY in_progress DESC, position",
            [name],
        ).fetchall()
    return [(r[0], r[1], r[2]) for r in rows]


def _lease_left_ms(dsn: str, request_id: str) -> float:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT extract(epoch FROM expires_at - clock_timestamp()) * 1000 "
            "FROM runcell_lease WHERE request_id = %s",
            [request_id],
        ).fetchone()
    assert row is not None, f"no lease for {request_id}"
    return float(row[0])


@pytest.fixture
def backend(pg_dsn: str) -> Iterator[PostgresBackend]:
    backend = PostgresBackend(database=pg_dsn)
    try:
        yield backend
    finally:
        backend.close()


def _limiter(backend: PostgresBackend, **options: object) -> PostgresConcurrencyLimiter:
    config = LimiterConfig.from_mapping(
        {"max_concurrent": 1, "claim_window_ms": CLAIM_WINDOW_MS, **options},
        name=unique_name("claim"),
    )
    limiter = backend.create_limiter(config)
    assert isinstance(limiter, PostgresConcurrencyLimiter)
    return limiter


def test_an_unclaimed_parked_grant_passes_to_the_next_waiter_after_the_claim_window(
    backend: PostgresBackend, pg_dsn: str
) -> None:
    limiter = _limiter(backend)
    held = limiter.acquire(_request(unique_name("holder")))
    parked, waiter = unique_name("parked"), unique_name("waiter")
    assert isinstance(
        limiter.acquire_or_park(
            [Member(limiter, _request(parked))], admission_wait_ms=0, payload=PAYLOAD
        ),
        Parked,
    )
    with ThreadPoolExecutor(1) as pool:
        # A plain waiter behind the parked request: its process waits, and reaps.
        waiting = pool.submit(limiter.acquire, _request(waiter))
        deadline = time.monotonic() + 10
        while len(_queue(pg_dsn, limiter.name)) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _queue(pg_dsn, limiter.name) == [(parked, True, False), (waiter, False, False)]

        limiter.release(held)  # granted to the parked request, whose task never comes
        granted_at = time.monotonic()
        assert _queue(pg_dsn, limiter.name)[0] == (parked, True, True)
        assert _lease_left_ms(pg_dsn, parked) <= CLAIM_WINDOW_MS, "held for the TTL"

        lease = waiting.result(timeout=15)  # the old rule: not before the parked deadline
        waited = time.monotonic() - granted_at
    assert isinstance(lease, Lease)
    assert waited >= CLAIM_WINDOW_MS / 1000 * 0.8, f"the slot passed on early ({waited:.2f} s)"
    assert waited < 10, f"the slot passed on {waited:.2f} s after the grant"
    # The parked request is back in line, not granted, holding nothing.
    assert _queue(pg_dsn, limiter.name) == [(parked, True, False)]
    stats = limiter.stats()
    assert (stats.active, stats.queued) == (1, 1)

    limiter.release(lease)  # its turn again: granted anew, to be re-published
    assert _queue(pg_dsn, limiter.name) == [(parked, True, True)]
    (claim,) = [c for c in backend.claim_republish(stale_ms=0) if c.limiter == limiter.name]
    assert claim.request_id == parked
    (claimed,) = limiter.claim_parked([limiter], parked, claim.publication_id)
    assert isinstance(claimed, Lease)
    limiter.release(claimed)


def test_an_unclaimed_parked_grant_goes_behind_the_requests_that_waited_after_it(
    backend: PostgresBackend, pg_dsn: str
) -> None:
    limiter = _limiter(backend)
    held = limiter.acquire(_request(unique_name("holder")))
    first, second, third = (unique_name(n) for n in ("first", "second", "third"))
    for request_id in (first, second, third):
        limiter.acquire_or_park(
            [Member(limiter, _request(request_id))], admission_wait_ms=0, payload=PAYLOAD
        )
    limiter.release(held)
    assert _queue(pg_dsn, limiter.name)[0] == (first, True, True)

    time.sleep(CLAIM_WINDOW_MS / 1000 + 0.3)  # first's task never claims its grant
    limiter.reap()
    # The slot went to the next in line; the unclaimed request waits at the back.
    assert _queue(pg_dsn, limiter.name) == [
        (second, True, True),
        (third, True, False),
        (first, True, False),
    ]


def test_a_claim_within_the_window_holds_the_slot_for_the_full_lease_ttl(
    backend: PostgresBackend, pg_dsn: str
) -> None:
    limiter = _limiter(backend, lease_ttl_ms=20_000)
    held = limiter.acquire(_request(unique_name("holder")))
    parked = unique_name("parked")
    limiter.acquire_or_park(
        [Member(limiter, _request(parked))], admission_wait_ms=0, payload=PAYLOAD
    )
    limiter.release(held)
    assert _lease_left_ms(pg_dsn, parked) <= CLAIM_WINDOW_MS
    (claim,) = [c for c in backend.claim_republish(stale_ms=0) if c.limiter == limiter.name]
    (lease,) = limiter.claim_parked([limiter], parked, claim.publication_id)
    assert isinstance(lease, Lease)
    assert _lease_left_ms(pg_dsn, parked) > 15_000
    time.sleep(CLAIM_WINDOW_MS / 1000 + 0.3)
    limiter.reap()  # past the window: the claimed lease is not reaped
    assert limiter.stats().active == 1
    assert _queue(pg_dsn, limiter.name) == []
    limiter.release(lease)


def test_the_postgres_factory_takes_a_claim_window_and_refuses_one_out_of_bounds(
    pg_dsn: str,
) -> None:
    limiter = create_postgres_concurrency_limiter(
        pg_dsn, name=unique_name("claim-factory"), max_concurrent=1, claim_window_ms=2_000
    )
    assert limiter.config.claim_window_ms == 2_000
    with pytest.raises(ConcurrencyConfigError, match="claim_window_ms"):
        create_postgres_concurrency_limiter(
            pg_dsn, name=unique_name("claim-factory"), max_concurrent=1, claim_window_ms=10
        )
