"""Limits stored again with more room (``on_conflict="replace"``, as
``runcell_sync_limiters --replace`` does) reach the requests already waiting at once:
storing them runs allocation, instead of leaving the waiters for the next release."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

import psycopg

from runcell_celery import AcquireRequest, RunLineage, run, slot
from runcell_celery.ports import Parked
from runcell_celery.postgres import PostgresConcurrencyLimiter
from runcell_celery.postgres.statements import PARKED_CHANNEL
from runcell_celery.protocol import Member
from tests.support.pg import unique_name

MakeLimiter = Callable[..., PostgresConcurrencyLimiter]

PAYLOAD = '{"task": "demo.summarize", "args": [42]}'
#: How soon after the new limits are stored both waiters must hold their slots.
GRANTED_WITHIN_S = 1.0


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.01)


class Waiters:
    """Threads that each wait for a slot of ``limiter`` and hold it until told."""

    def __init__(self, limiter: PostgresConcurrencyLimiter, count: int) -> None:
        self.granted_at: list[float] = []
        self.failures: list[BaseException] = []
        self.done = threading.Event()
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._wait, args=(limiter,)) for _ in range(count)]
        for thread in self.threads:
            thread.start()

    def _wait(self, limiter: PostgresConcurrencyLimiter) -> None:
        try:
            with run(timeout_ms=20_000), slot(limiter):
                with self._lock:
                    self.granted_at.append(time.monotonic())
                self.done.wait(20)
        except BaseException as exc:  # reported by the test
            self.failures.append(exc)

    def finish(self) -> None:
        self.done.set()
        for thread in self.threads:
            thread.join(20)
        assert self.failures == []


def assert_both_granted_at_once(waiters: Waiters, stored_at: float) -> None:
    wait_for(lambda: len(waiters.granted_at) == 2 or bool(waiters.failures), "both granted", 5)
    assert waiters.failures == []
    after = [at - stored_at for at in waiters.granted_at]
    late = [round(s, 2) for s in after if s > GRANTED_WITHIN_S]
    assert late == [], f"granted {late} s after the new limits were stored"


def test_a_raised_limit_grants_the_requests_already_waiting_while_the_first_still_holds(
    make_limiter: MakeLimiter,
) -> None:
    name = unique_name()
    limiter = make_limiter(name=name, max_concurrent=1)
    # The waiters' worker follows stored limits (on_conflict="use_stored"): granted by
    # the raised limit without anything of its own, then working on it.
    follower = make_limiter(name=name, max_concurrent=1, on_conflict="use_stored")
    with slot(limiter):
        waiters = Waiters(follower, 2)
        try:
            wait_for(lambda: limiter.stats().queued == 2, "two requests waiting")
            stored_at = time.monotonic()
            raised = make_limiter(name=name, max_concurrent=3, on_conflict="replace")
            assert_both_granted_at_once(waiters, stored_at)
            stats = raised.stats()
            assert (stats.active, stats.queued) == (3, 0)
        finally:
            waiters.finish()
    with run(timeout_ms=5_000), slot(follower), slot(follower), slot(follower):
        assert follower.stats().active == 3
    assert (limiter.stats().active, limiter.stats().queued) == (0, 0)


def test_a_raised_limit_per_key_grants_the_requests_already_waiting_on_a_key(
    make_limiter: MakeLimiter,
) -> None:
    name = unique_name("tenant")
    tenants = make_limiter(name=name, max_concurrent=1, keyed=True)
    acme = tenants.key("acme")
    with slot(acme):
        waiters = Waiters(acme, 2)
        try:
            wait_for(lambda: acme.stats().queued == 2, "two requests waiting on the key")
            stored_at = time.monotonic()
            raised = make_limiter(name=name, max_concurrent=3, keyed=True, on_conflict="replace")
            assert_both_granted_at_once(waiters, stored_at)
            stats = raised.key("acme").stats()
            assert (stats.active, stats.queued) == (3, 0)
        finally:
            waiters.finish()
    assert (acme.stats().active, acme.stats().queued) == (0, 0)


def _request(request_id: str) -> AcquireRequest:
    return AcquireRequest(
        request_id=request_id, workload="default", lineage=RunLineage(request_id, request_id)
    )


def test_a_raised_limit_grants_parked_requests_and_announces_them_for_re_publishing(
    make_limiter: MakeLimiter, pg_dsn: str
) -> None:
    name = unique_name()
    limiter = make_limiter(name=name, max_concurrent=1)
    held = limiter.acquire(_request(unique_name("holder")))
    parked = [unique_name("first"), unique_name("second")]
    for request_id in parked:
        answer = limiter.acquire_or_park(
            [Member(limiter, _request(request_id))], admission_wait_ms=0, payload=PAYLOAD
        )
        assert isinstance(answer, Parked)
    with psycopg.connect(pg_dsn, autocommit=True) as listener:
        listener.execute(f"LISTEN {PARKED_CHANNEL}")
        stored_at = time.monotonic()
        make_limiter(name=name, max_concurrent=3, on_conflict="replace")
        announced: list[str] = []
        until = stored_at + GRANTED_WITHIN_S
        while len(announced) < len(parked) and time.monotonic() < until:
            for notify in listener.notifies(timeout=until - time.monotonic(), stop_after=1):
                message = json.loads(notify.payload)
                if message.get("l") == name:
                    announced.extend(message["p"])
        elapsed = time.monotonic() - stored_at
    assert sorted(announced) == sorted(parked), "the grants were not announced to re-publishers"
    assert elapsed < GRANTED_WITHIN_S
    with psycopg.connect(pg_dsn) as conn:
        rows = conn.execute(
            "SELECT request_id, granted_lease_id IS NOT NULL FROM runcell_queue "
            "WHERE limiter = %s ORDER BY position",
            [name],
        ).fetchall()
    assert rows == [(parked[0], True), (parked[1], True)]
    stats = limiter.stats()
    assert (stats.active, stats.queued) == (3, 0)
    limiter.release(held)
