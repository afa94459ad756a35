"""A request over several PostgreSQL limiters parks as one request (admission deferral).

Parked, it keeps its place in every limiter and holds nothing; granted, it gets one
parked lease per limiter together and its message is published once; the re-published
task claims every lease or none; a grant nobody claims passes on; a deadline that
passes while it is parked fails it once; another delivery asking with its id is a
duplicate; and a reply lost after the park committed gets the first answer.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

from runcell_celery import AcquireRequest, Lease, RunLineage
from runcell_celery.ports import Duplicate, Parked, Republish, SupportsParking
from runcell_celery.postgres import (
    PostgresBackend,
    PostgresConcurrencyLimiter,
    create_postgres_concurrency_limiter,
)
from runcell_celery.protocol import Member
from tests.support.pg import unique_name
from tests.support.reply_dropper import ReplyDropper

MakeLimiter = Callable[..., PostgresConcurrencyLimiter]
PAYLOAD = '{"task": "agents.answer", "args": ["acme"]}'


def _requests(request_id: str, n: int = 2, **extra: Any) -> list[AcquireRequest]:
    return [
        AcquireRequest(
            request_id=request_id,
            workload="default",
            lineage=RunLineage(request_id, request_id),
            **extra,
        )
        for _ in range(n)
    ]


def _rows(dsn: str, group: str) -> list[tuple[str, bool, bool, bool]]:
    """(limiter, parked, granted, carries the message) of each member, by limiter."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT limiter, parked, granted_lease_id IS NOT NULL, payload IS NOT NULL "
            "FROM runcell_queue WHERE group_id = %s ORDER BY limiter",
            [group],
        ).fetchall()
    return [(r[0], r[1], r[2], r[3]) for r in rows]


def _mine(claims: list[Republish], group: str) -> list[Republish]:
    return [c for c in claims if c.request_id.startswith(f"{group}|")]


@pytest.fixture
def backend(pg_dsn: str) -> Iterator[PostgresBackend]:
    made = PostgresBackend(database=pg_dsn)
    try:
        yield made
    finally:
        made.close()


def _park(
    a: PostgresConcurrencyLimiter, b: PostgresConcurrencyLimiter, group: str, **extra: Any
) -> tuple[Lease, ...] | Parked | str:
    return a.acquire_or_park(
        [Member(x, r) for x, r in zip([a, b], _requests(group, **extra), strict=True)],
        admission_wait_ms=0,
        payload=PAYLOAD,
    )


def test_a_parked_request_keeps_a_place_in_each_limiter_and_is_granted_and_claimed_as_one(
    make_limiter: MakeLimiter, pg_dsn: str, backend: PostgresBackend
) -> None:
    a = make_limiter(max_concurrent=1)
    b = make_limiter(max_concurrent=1)
    assert isinstance(a, SupportsParking)
    held = b.acquire(_requests(unique_name("holder"), 1)[0])
    group = unique_name("parked")

    parked = _park(a, b, group)

    assert isinstance(parked, Parked)
    assert parked.limiter == " + ".join(sorted([a.name, b.name]))
    first, second = sorted([a.name, b.name])
    # Parked everywhere; only the first member in name order carries the message.
    assert _rows(pg_dsn, group) == [(first, True, False, True), (second, True, False, False)]
    assert (a.stats().active, b.stats().active) == (0, 1), "it holds a's slot while parked"

    granted: list[list[str]] = []
    a.set_parked_granted_handler(granted.append)
    b.release(held)  # the releaser runs its group pass: granted as a parked request
    assert _rows(pg_dsn, group) == [(first, True, True, True), (second, True, True, False)]
    assert (a.stats().active, b.stats().active) == (1, 1)

    claims = _mine(backend.claim_republish(stale_ms=0), group)
    assert [c.request_id for c in claims] == [f"{group}|{first}"], "published more than once"
    assert json.loads(claims[0].payload) == json.loads(PAYLOAD)
    assert _mine(backend.claim_republish(stale_ms=0), group) == []

    stale = a.claim_parked([a, b], group, "00000000-0000-0000-0000-000000000000")
    assert stale == "stale"
    leases = b.claim_parked([b, a], group, claims[0].publication_id)
    assert isinstance(leases, tuple)
    assert [lease.limiter for lease in leases] == [b.name, a.name], "not in the caller's order"
    assert a.claim_parked([a, b], group, claims[0].publication_id) == "missing"
    assert _rows(pg_dsn, group) == []
    for limiter, lease in zip([b, a], leases, strict=True):
        assert limiter.renew(lease) is not None, "a claimed lease is not held"
        limiter.release(lease)
    assert (a.stats().active, b.stats().active) == (0, 0)


def test_a_parked_request_waits_its_turn_in_every_limiter(
    make_limiter: MakeLimiter, pg_dsn: str, backend: PostgresBackend
) -> None:
    a = make_limiter(max_concurrent=1)
    b = make_limiter(max_concurrent=1)
    held_a = a.acquire(_requests(unique_name("holder-a"), 1)[0])
    held_b = b.acquire(_requests(unique_name("holder-b"), 1)[0])
    group = unique_name("parked")
    assert isinstance(_park(a, b, group), Parked)

    a.release(held_a)  # room in a, none in b: nothing is granted
    assert [granted for _, _, granted, _ in _rows(pg_dsn, group)] == [False, False]
    assert a.stats().active == 0
    b.release(held_b)
    assert [granted for _, _, granted, _ in _rows(pg_dsn, group)] == [True, True]


def test_the_sweepers_group_pass_grants_a_parked_request_no_releaser_saw(
    make_limiter: MakeLimiter, pg_dsn: str, backend: PostgresBackend
) -> None:
    a = make_limiter(max_concurrent=1)
    b = make_limiter(max_concurrent=1, lease_ttl_ms=300)
    b.acquire(_requests(unique_name("holder"), 1)[0])  # a holder that dies
    group = unique_name("parked")
    assert isinstance(_park(a, b, group), Parked)
    time.sleep(0.4)  # the holder died: its lease expired, and nobody released it
    b.reap()  # the slot comes back, but a reap runs no group pass of its own

    granted = backend.pass_parked_groups()

    assert [granted for _, _, granted, _ in _rows(pg_dsn, group)] == [True, True]
    claims = _mine(backend.claim_republish(granted, stale_ms=60_000), group)
    assert len(claims) == 1, "the sweeper's grant was not handed over to be published"


def test_a_grant_nobody_claims_passes_on_and_the_request_is_granted_again_later(
    make_limiter: MakeLimiter, pg_dsn: str, backend: PostgresBackend
) -> None:
    a = make_limiter(max_concurrent=1, lease_ttl_ms=300)
    b = make_limiter(max_concurrent=1, lease_ttl_ms=300)
    held = a.acquire(_requests(unique_name("holder"), 1)[0])
    group = unique_name("parked")
    assert isinstance(_park(a, b, group), Parked)
    a.release(held)
    first = _mine(backend.claim_republish(stale_ms=0), group)
    assert len(first) == 1
    time.sleep(0.4)  # its task never started: the claim windows end
    a.reap()
    b.reap()
    # Back in line in both, then granted again as a whole (the sweeper's pass).
    backend.pass_parked_groups()
    assert [granted for _, _, granted, _ in _rows(pg_dsn, group)] == [True, True]
    again = _mine(backend.claim_republish(stale_ms=0), group)
    assert len(again) == 1
    assert again[0].publication_id != first[0].publication_id
    # The first publication's copy is outdated; the new one claims both leases.
    assert a.claim_parked([a, b], group, first[0].publication_id) == "stale"
    leases = a.claim_parked([a, b], group, again[0].publication_id)
    assert isinstance(leases, tuple)
    for limiter, lease in zip([a, b], leases, strict=True):
        limiter.release(lease)


def test_a_claim_with_one_lease_past_its_window_takes_none(
    make_limiter: MakeLimiter, pg_dsn: str, backend: PostgresBackend
) -> None:
    a = make_limiter(max_concurrent=1, lease_ttl_ms=300)
    b = make_limiter(max_concurrent=1, lease_ttl_ms=30_000)
    held = a.acquire(_requests(unique_name("holder"), 1)[0])
    group = unique_name("parked")
    assert isinstance(_park(a, b, group), Parked)
    a.release(held)
    (claim,) = _mine(backend.claim_republish(stale_ms=0), group)
    time.sleep(0.4)  # a's claim window (its 300 ms TTL) ended; b's is 5 s

    assert a.claim_parked([a, b], group, claim.publication_id) == "stale"
    assert b.stats().active == 1, "b's lease was taken alone"
    with psycopg.connect(pg_dsn) as conn:
        picked = conn.execute(
            "SELECT count(*) FROM runcell_lease WHERE request_id LIKE %s AND picked_up_at "
            "IS NOT NULL",
            [f"{group}|%"],
        ).fetchone()
    assert picked == (0,)


def test_another_delivery_asking_with_a_parked_and_granted_requests_id_is_a_duplicate(
    make_limiter: MakeLimiter, backend: PostgresBackend
) -> None:
    a = make_limiter(max_concurrent=1)
    b = make_limiter(max_concurrent=1)
    held = a.acquire(_requests(unique_name("holder"), 1)[0])
    group = unique_name("parked")
    assert isinstance(_park(a, b, group), Parked)
    a.release(held)  # granted while parked: its own publication carries it

    assert isinstance(_park(a, b, group), Duplicate)
    assert (a.stats().active, b.stats().active) == (1, 1), "the duplicate took slots"


def test_a_parked_request_whose_deadline_passes_fails_once(
    make_limiter: MakeLimiter, pg_dsn: str, backend: PostgresBackend
) -> None:
    a = make_limiter(max_concurrent=1)
    b = make_limiter(max_concurrent=1)
    held = a.acquire(_requests(unique_name("holder"), 1)[0])
    group = unique_name("parked")
    assert isinstance(_park(a, b, group, timeout_ms=300), Parked)
    time.sleep(0.4)

    taken = [e for e in backend.take_expired_parked() if e.request_id.startswith(f"{group}|")]

    assert [e.request_id for e in taken] == [f"{group}|{min(a.name, b.name)}"]
    assert json.loads(taken[0].payload) == json.loads(PAYLOAD)
    assert backend.complete_expired_parked(taken) == 1
    assert _rows(pg_dsn, group) == []
    assert (a.stats().queued, b.stats().queued) == (0, 0), "a member is still counted waiting"
    a.release(held)


def test_withdrawing_a_parked_request_leaves_every_line(
    make_limiter: MakeLimiter, pg_dsn: str
) -> None:
    a = make_limiter(max_concurrent=1)
    b = make_limiter(max_concurrent=1)
    held = a.acquire(_requests(unique_name("holder"), 1)[0])
    group = unique_name("parked")
    assert isinstance(_park(a, b, group), Parked)

    a.withdraw_members([a, b], group)

    assert _rows(pg_dsn, group) == []
    assert (a.stats().queued, b.stats().queued) == (0, 0)
    a.release(held)
    assert a.stats().active == 0


def test_a_request_granted_while_it_waits_before_parking_keeps_its_leases(
    make_limiter: MakeLimiter,
) -> None:
    a = make_limiter(max_concurrent=1)
    b = make_limiter(max_concurrent=1)
    held = a.acquire(_requests(unique_name("holder"), 1)[0])
    group = unique_name("waiting")
    timer = threading.Timer(0.2, a.release, [held])
    timer.start()
    try:
        result = a.acquire_or_park(
            [Member(x, r) for x, r in zip([a, b], _requests(group), strict=True)],
            admission_wait_ms=5_000,
            payload=PAYLOAD,
        )
    finally:
        timer.join()
    assert isinstance(result, tuple), f"parked though granted within its wait: {result!r}"
    for limiter, lease in zip([a, b], result, strict=True):
        limiter.release(lease)


class _Pair:
    """Two limiters of one database, each made twice: direct, and through a proxy that
    can lose the reply to one statement after it committed."""

    def __init__(self, pg_dsn: str, dropper: ReplyDropper) -> None:
        params = psycopg.conninfo.conninfo_to_dict(pg_dsn)
        params.update(host="127.0.0.1", port=str(dropper.port))
        proxied_dsn = psycopg.conninfo.make_conninfo(**params)
        names = sorted([unique_name("lost-a"), unique_name("lost-b")])
        self.direct = [
            create_postgres_concurrency_limiter(pg_dsn, name=n, max_concurrent=1) for n in names
        ]
        self.proxied = [
            create_postgres_concurrency_limiter(proxied_dsn, name=n, max_concurrent=1, listen=False)
            for n in names
        ]


@pytest.fixture
def dropper(pg_dsn: str) -> Iterator[ReplyDropper]:
    params = psycopg.conninfo.conninfo_to_dict(pg_dsn)
    where = (str(params.get("host") or "127.0.0.1"), int(params.get("port") or 5432))
    with ReplyDropper(where) as proxy:
        yield proxy


def test_a_lost_reply_to_a_group_park_gets_its_answer_even_when_a_grant_came_in_between(
    pg_dsn: str, dropper: ReplyDropper
) -> None:
    pair = _Pair(pg_dsn, dropper)
    held = pair.direct[0].acquire(_requests(unique_name("holder"), 1)[0])
    group = unique_name("parked")
    # The park commits; before its reply arrives, the slot frees and the group is
    # granted (as a parked request).
    dropper.arm(b"runcell_park(", before_cut=lambda: pair.direct[0].release(held))

    answer = pair.proxied[0].acquire_or_park(
        [Member(x, r) for x, r in zip(pair.proxied, _requests(group), strict=True)],
        admission_wait_ms=0,
        payload=PAYLOAD,
    )

    assert dropper.dropped[b"runcell_park("] == 1, "no reply was lost"
    assert isinstance(answer, Parked), f"the retry read its own park as {answer!r}"
    assert [granted for _, _, granted, _ in _rows(pg_dsn, group)] == [True, True]


def test_a_lost_reply_to_a_group_claim_gives_every_claimed_lease_to_the_retry(
    pg_dsn: str, dropper: ReplyDropper, backend: PostgresBackend
) -> None:
    pair = _Pair(pg_dsn, dropper)
    held = pair.direct[0].acquire(_requests(unique_name("holder"), 1)[0])
    group = unique_name("parked")
    assert isinstance(_park(pair.direct[0], pair.direct[1], group), Parked)
    pair.direct[0].release(held)
    (claim,) = _mine(backend.claim_republish(stale_ms=0), group)
    dropper.arm(b"runcell_claim(")

    leases = pair.proxied[0].claim_parked(pair.proxied, group, claim.publication_id)

    assert dropper.dropped[b"runcell_claim("] == 1, "no reply was lost"
    assert isinstance(leases, tuple), f"the retry read its own claim as {leases!r}"
    for limiter, lease in zip(pair.direct, leases, strict=True):
        assert limiter.renew(lease) is not None, "a claimed lease is not held"
        limiter.release(lease)
