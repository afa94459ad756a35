"""Operations on parked requests survive a reply lost after they committed.

Each test puts a :class:`~tests.support.reply_dropper.ReplyDropper` between one limiter
(or backend) and PostgreSQL and loses the reply to one operation after it committed:
the client's retry must get the first attempt's answer, never read its own work as
someone else's. A second limiter with the same name talks to the server directly.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from runcell_celery import AcquireRequest, Lease, RunLineage
from runcell_celery.ports import Parked
from runcell_celery.postgres import (
    PostgresBackend,
    PostgresConcurrencyLimiter,
    create_postgres_concurrency_limiter,
)
from runcell_celery.protocol import Member
from tests.support.pg import unique_name
from tests.support.reply_dropper import ReplyDropper

PAYLOAD = '{"task": "demo.summarize", "args": [42]}'


def _request(request_id: str, *, timeout_ms: float | None = None) -> AcquireRequest:
    return AcquireRequest(
        request_id=request_id,
        workload="default",
        lineage=RunLineage(request_id, request_id),
        timeout_ms=timeout_ms,
    )


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


def _pair(
    pg_dsn: str, proxy: ReplyDropper, **limits: Any
) -> tuple[PostgresConcurrencyLimiter, PostgresConcurrencyLimiter]:
    """The same limiter twice: through the proxy, and direct."""
    options = {"name": unique_name("lost-reply"), "max_concurrent": 1, "poll_interval_ms": 20}
    options.update(limits)
    direct = create_postgres_concurrency_limiter(pg_dsn, **options)
    proxied = create_postgres_concurrency_limiter(_via(proxy, pg_dsn), listen=False, **options)
    return proxied, direct


def _in_thread(function: Any, timeout: float) -> Any:
    """Run ``function`` in a daemon thread: a retry that loops for ever (the bug this
    guards against) fails the test instead of hanging it."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = function()
        except BaseException as exc:  # handed to the test
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"still running after {timeout} s"
    if "error" in box:
        raise box["error"]
    return box["value"]


def _queue(dsn: str, name: str) -> dict[str, tuple[bool, str | None]]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT request_id, parked, granted_lease_id::text FROM runcell_queue "
            "WHERE limiter = %s",
            [name],
        ).fetchall()
    return {r[0]: (r[1], r[2]) for r in rows}


def test_a_lost_reply_to_park_gets_its_answer_even_when_a_grant_came_in_between(
    pg_dsn: str, dropper: ReplyDropper
) -> None:
    proxied, direct = _pair(pg_dsn, dropper)
    held = direct.acquire(_request(unique_name("holder")))
    request_id = unique_name("parked")
    # The park commits; before its reply arrives, the slot frees and goes to it.
    dropper.arm(b"runcell_park(", before_cut=lambda: direct.release(held))

    answer = _in_thread(
        lambda: proxied.acquire_or_park(
            [Member(proxied, _request(request_id))], admission_wait_ms=0, payload=PAYLOAD
        ),
        timeout=20,
    )

    assert dropper.dropped[b"runcell_park("] == 1, "no reply was lost; proves nothing"
    assert isinstance(answer, Parked)
    parked, granted = _queue(pg_dsn, proxied.name)[request_id]
    assert parked
    assert granted is not None, "the parked request lost its grant"


def test_a_lost_reply_to_claim_gives_the_claimed_lease_to_the_retry(
    pg_dsn: str, dropper: ReplyDropper
) -> None:
    proxied, direct = _pair(pg_dsn, dropper)
    held = direct.acquire(_request(unique_name("holder")))
    request_id = unique_name("parked")
    assert isinstance(
        direct.acquire_or_park(
            [Member(direct, _request(request_id))], admission_wait_ms=0, payload=PAYLOAD
        ),
        Parked,
    )
    direct.release(held)  # granted to the parked request
    backend = PostgresBackend(database=pg_dsn)
    (claim,) = [c for c in backend.claim_republish(stale_ms=0) if c.limiter == proxied.name]
    dropper.arm(b"runcell_claim(")

    claimed = _in_thread(
        lambda: proxied.claim_parked([proxied], request_id, claim.publication_id), 20
    )

    assert dropper.dropped[b"runcell_claim("] == 1, "no reply was lost"
    assert isinstance(claimed, tuple), f"the retry read its own claim as {claimed!r}"
    (lease,) = claimed
    assert isinstance(lease, Lease)
    assert request_id not in _queue(pg_dsn, proxied.name)
    assert proxied.renew(lease) is not None, "the claimed lease is not held"
    proxied.release(lease)


def test_a_lost_reply_to_withdraw_still_hands_its_grants_to_be_published(
    pg_dsn: str, dropper: ReplyDropper
) -> None:
    proxied, direct = _pair(pg_dsn, dropper)
    held = direct.acquire(_request(unique_name("holder")))
    first, second = unique_name("first"), unique_name("second")
    for request_id in (first, second):
        assert isinstance(
            direct.acquire_or_park(
                [Member(direct, _request(request_id))], admission_wait_ms=0, payload=PAYLOAD
            ),
            Parked,
        )
    direct.release(held)  # granted to the first; the second waits behind it
    published: list[list[str]] = []
    proxied.set_parked_granted_handler(published.append)
    dropper.arm(b"runcell_withdraw(")

    # The first's run ends before it uses its grant: the slot goes to the second, whose
    # task must be re-published at once, retry or not.
    _in_thread(lambda: proxied.withdraw_members([proxied], first), 20)

    assert dropper.dropped[b"runcell_withdraw("] == 1, "no reply was lost"
    queue = _queue(pg_dsn, proxied.name)
    assert first not in queue
    granted_to_second = queue[second][1]
    assert granted_to_second is not None
    assert published == [[granted_to_second]], "the retry forgot what the withdrawal granted"


def test_a_lost_reply_to_complete_reports_the_rows_it_deleted(
    pg_dsn: str, dropper: ReplyDropper
) -> None:
    proxied, direct = _pair(pg_dsn, dropper)
    held = direct.acquire(_request(unique_name("holder")))
    request_id = unique_name("stale")
    assert isinstance(
        direct.acquire_or_park(
            [Member(direct, _request(request_id, timeout_ms=50))],
            admission_wait_ms=0,
            payload=PAYLOAD,
        ),
        Parked,
    )
    time.sleep(0.1)  # its deadline passes while it is parked
    backend = PostgresBackend(database=_via(dropper, pg_dsn))
    expired = [e for e in backend.take_expired_parked() if e.request_id == request_id]
    assert len(expired) == 1
    dropper.arm(b"runcell_complete_expired(")

    deleted = _in_thread(lambda: backend.complete_expired_parked(expired), 20)

    assert dropper.dropped[b"runcell_complete_expired("] == 1, "no reply was lost"
    assert deleted == 1
    assert request_id not in _queue(pg_dsn, proxied.name)
    direct.release(held)
