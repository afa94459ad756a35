"""When a deferrable request parks: by its expected wait, not after a fixed 500 ms.

The acquire's "queued" answer gives the request's place in its workload's line and
the limiter's mean hold time, which every release keeps up to date in the update it
makes anyway; ``acquire_or_park`` parks at once when ``(ahead + 1) * hold / slots``
exceeds ``defer_after_ms``, else waits up to it. Hold histories are made by real
leases released after their ``acquired_at`` was moved back (a lease "held for 2 s"
without a test sleeping 2 s).
"""

from __future__ import annotations

import os
import re
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg import pq
from psycopg_pool import ConnectionPool

from runcell_celery import AcquireRequest, ConcurrencyConfigError, Lease, RunLineage
from runcell_celery.ports import Parked
from runcell_celery.postgres import PostgresConcurrencyLimiter, create_postgres_concurrency_limiter
from runcell_celery.protocol import Member
from tests.support.pg import unique_name

PAYLOAD = '{"task": "demo.summarize", "args": [42]}'


def _request(prefix: str) -> AcquireRequest:
    request_id = unique_name(prefix)
    return AcquireRequest(
        request_id=request_id, workload="default", lineage=RunLineage(request_id, request_id)
    )


def _held_for(limiter: PostgresConcurrencyLimiter, dsn: str, hold_ms: float) -> None:
    """Take a slot and release it as if it had been held ``hold_ms``."""
    lease = limiter.acquire(_request("history"))
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "UPDATE runcell_lease SET acquired_at = acquired_at - %s * interval '1 millisecond' "
            "WHERE lease_id = %s",
            [hold_ms, lease.lease_id],
        )
    limiter.release(lease)


def _mean_hold_ms(dsn: str, name: str) -> float | None:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT hold_ms_avg FROM runcell_limiter WHERE name = %s", [name])
        found = row.fetchone()
    assert found is not None
    return None if found[0] is None else float(found[0])


def _parked_rows(dsn: str, name: str) -> list[str]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT request_id FROM runcell_queue WHERE limiter = %s AND parked ORDER BY position",
            [name],
        ).fetchall()
    return [row[0] for row in rows]


def _line_of(limiter: PostgresConcurrencyLimiter, waiting: int) -> None:
    """Put ``waiting`` requests in line (parked, so no thread waits for them)."""
    for _ in range(waiting):
        parked = limiter.acquire_or_park(
            [Member(limiter, _request("ahead"))], admission_wait_ms=0, payload=PAYLOAD
        )
        assert isinstance(parked, Parked)


def test_a_deferrable_request_behind_a_long_line_parks_at_once(
    make_limiter: Callable[..., PostgresConcurrencyLimiter], pg_dsn: str
) -> None:
    limiter = make_limiter(max_concurrent=1)
    _held_for(limiter, pg_dsn, 2_000)  # recent holds: 2 s
    holder = limiter.acquire(_request("holder"))
    _line_of(limiter, 3)

    started = time.monotonic()
    result = limiter.acquire_or_park([Member(limiter, _request("late"))], payload=PAYLOAD)
    took_s = time.monotonic() - started

    # Expected wait (3 + 1) x 2 s / 1 slot = 8 s, over the 1 s threshold: no waiting
    # first (the old default waited 500 ms; the threshold alone would wait 1 s).
    assert isinstance(result, Parked)
    assert isinstance(result, Parked)
    assert took_s < 0.5, f"parked after {took_s:.3f} s instead of at once"
    assert (result.place, result.limiter, result.workload) == (4, limiter.name, "default")
    assert result.expected_wait_ms == pytest.approx(8_000, rel=0.05)
    assert result.waited_ms < 500
    assert len(_parked_rows(pg_dsn, limiter.name)) == 4
    limiter.release(holder)


def test_a_request_expected_to_wait_briefly_waits_and_gets_the_slot_without_parking(
    make_limiter: Callable[..., PostgresConcurrencyLimiter], pg_dsn: str
) -> None:
    limiter = make_limiter(max_concurrent=1)
    _held_for(limiter, pg_dsn, 20)  # recent holds: 20 ms
    holder = limiter.acquire(_request("holder"))
    # Released after 700 ms: longer than the old fixed 500 ms wait (which would have
    # parked it), shorter than the 1 s threshold it may wait under the rule.
    releaser = threading.Timer(0.7, limiter.release, [holder])
    releaser.start()
    try:
        result = limiter.acquire_or_park([Member(limiter, _request("soon"))], payload=PAYLOAD)
    finally:
        releaser.join()
    assert isinstance(result, tuple), f"expected a slot, got {result!r}"
    (lease,) = result
    assert isinstance(lease, Lease)
    assert _parked_rows(pg_dsn, limiter.name) == []
    limiter.release(lease)


def test_a_request_with_no_hold_history_waits_up_to_the_threshold_then_parks(
    make_limiter: Callable[..., PostgresConcurrencyLimiter], pg_dsn: str
) -> None:
    limiter = make_limiter(max_concurrent=1)
    holder = limiter.acquire(_request("holder"))  # no release yet: nothing to estimate
    started = time.monotonic()
    result = limiter.acquire_or_park(
        [Member(limiter, _request("first"))], payload=PAYLOAD, defer_after_ms=300
    )
    took_s = time.monotonic() - started
    assert isinstance(result, Parked)
    assert took_s >= 0.3, "it parked before its threshold without any estimate"
    assert (result.place, result.expected_wait_ms) == (1, None)
    limiter.release(holder)


def test_an_explicit_admission_wait_keeps_its_fixed_wait_whatever_the_estimate(
    make_limiter: Callable[..., PostgresConcurrencyLimiter], pg_dsn: str
) -> None:
    limiter = make_limiter(max_concurrent=1)
    _held_for(limiter, pg_dsn, 2_000)
    holder = limiter.acquire(_request("holder"))
    _line_of(limiter, 3)

    started = time.monotonic()
    result = limiter.acquire_or_park(
        [Member(limiter, _request("fixed"))], admission_wait_ms=300, payload=PAYLOAD
    )
    took_s = time.monotonic() - started

    # The rule would park it at once (8 s expected); the explicit wait is kept.
    assert isinstance(result, Parked)
    assert took_s >= 0.3, f"parked after {took_s:.3f} s, before its 300 ms admission wait"
    assert result.place == 4  # the place is still reported for the log line
    limiter.release(holder)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"defer_after_ms": -1}, r"defer_after_ms = -1 is invalid: must not be negative"),
        ({"defer_after_ms": 1e300}, r"defer_after_ms = 1e\+300 is invalid: must be at most"),
        ({"defer_after_ms": "1s"}, r"defer_after_ms = '1s' is invalid: must be a number"),
        ({"admission_wait_ms": -5}, r"admission_wait_ms = -5 is invalid: must not be negative"),
    ],
)
def test_a_bad_admission_threshold_is_refused_naming_it_before_anything_is_queued(
    make_limiter: Callable[..., PostgresConcurrencyLimiter],
    pg_dsn: str,
    options: dict[str, Any],
    message: str,
) -> None:
    limiter = make_limiter(max_concurrent=1)
    holder = limiter.acquire(_request("holder"))
    request = _request("refused")
    with pytest.raises(ConcurrencyConfigError, match=message):
        limiter.acquire_or_park([Member(limiter, request)], payload=PAYLOAD, **options)
    with psycopg.connect(pg_dsn) as conn:
        queued = conn.execute(
            "SELECT count(*) FROM runcell_queue WHERE request_id = %s", [request.request_id]
        ).fetchone()
    assert queued == (0,)
    limiter.release(holder)


def test_each_release_folds_its_hold_into_the_mean_as_an_exponential_average(
    make_limiter: Callable[..., PostgresConcurrencyLimiter], pg_dsn: str
) -> None:
    limiter = make_limiter(max_concurrent=1)
    assert _mean_hold_ms(pg_dsn, limiter.name) is None
    _held_for(limiter, pg_dsn, 2_000)
    first = _mean_hold_ms(pg_dsn, limiter.name)
    assert first == pytest.approx(2_000, abs=100)  # the first hold is the mean
    _held_for(limiter, pg_dsn, 1_000)
    second = _mean_hold_ms(pg_dsn, limiter.name)
    assert first is not None
    assert second is not None
    # The newest hold weighs 0.2: 2000 + 0.2 x (1000 - 2000) = 1800.
    assert second == pytest.approx(first + 0.2 * (1_000 - first), abs=50)


class _Wire:
    """Every query message each pooled connection sends, read from libpq's own trace
    (what went over the wire, not what the code meant to send)."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        self.marks: dict[str, int] = {}

    def configure(self, conn: psycopg.Connection[Any]) -> None:
        handle, path = tempfile.mkstemp(prefix="runcell-wire-")
        self.paths.append(path)
        conn.pgconn.trace(handle)
        conn.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS | pq.Trace.REGRESS_MODE)

    def mark(self) -> None:
        self.marks = {path: os.path.getsize(path) for path in self.paths}

    def queries_since_mark(self) -> list[str]:
        sent: list[str] = []
        for path in self.paths:
            with open(path, "rb") as trace:
                trace.seek(self.marks.get(path, 0))
                # A message may span lines (a query's own newlines): each starts with
                # its direction and length.
                text = trace.read().decode(errors="replace")
                for message in re.split(r"^(?=[FB]\t\d+\t)", text, flags=re.MULTILINE):
                    fields = message.split("\t", 3)
                    if len(fields) == 4 and fields[0] == "F" and fields[2] in ("Query", "Parse"):
                        sent.append(fields[3])
        return sent


@pytest.fixture
def wire(pg_dsn: str) -> Iterator[tuple[_Wire, Callable[..., PostgresConcurrencyLimiter]]]:
    traced = _Wire()
    pool: ConnectionPool[Any] = ConnectionPool(
        pg_dsn,
        min_size=2,
        max_size=2,
        kwargs={"autocommit": True, "prepare_threshold": None},
        configure=traced.configure,
        open=True,
    )

    def make(**options: Any) -> PostgresConcurrencyLimiter:
        options.setdefault("name", unique_name("wire"))
        return create_postgres_concurrency_limiter(pool, **options)

    try:
        yield traced, make
    finally:
        pool.close()
        for path in traced.paths:
            os.unlink(path)


def _operations(queries: list[str], name: str) -> list[str]:
    """The runcell functions called for limiter ``name`` (the process's safety poll and
    lease renewals, which run on their own schedule, left out)."""
    called: list[str] = []
    for query in queries:
        if name not in query or "runcell_poll" in query or "runcell_renew" in query:
            continue
        called.extend(word.split("(")[0] for word in query.split() if word.startswith("runcell_"))
    return called


def test_acquire_and_release_stay_one_round_trip_each_while_keeping_the_estimate(
    wire: tuple[_Wire, Callable[..., PostgresConcurrencyLimiter]], pg_dsn: str
) -> None:
    traced, make = wire
    limiter = make(max_concurrent=1)

    traced.mark()
    lease = limiter.acquire(_request("one"))
    assert _operations(traced.queries_since_mark(), limiter.name) == ["runcell_acquire"]

    traced.mark()
    limiter.release(lease)  # keeps the mean hold in the same call
    assert _operations(traced.queries_since_mark(), limiter.name) == ["runcell_release"]
    assert _mean_hold_ms(pg_dsn, limiter.name) is not None

    holder = limiter.acquire(_request("holder"))
    with psycopg.connect(pg_dsn, autocommit=True) as conn:  # a long history: park at once
        conn.execute(
            "UPDATE runcell_limiter SET hold_ms_avg = 60000 WHERE name = %s", [limiter.name]
        )
    traced.mark()
    parked = limiter.acquire_or_park([Member(limiter, _request("parks"))], payload=PAYLOAD)
    assert isinstance(parked, Parked)
    assert parked.place == 1
    # The estimate came with the acquire's answer: an acquire, then the park, nothing else.
    assert _operations(traced.queries_since_mark(), limiter.name) == [
        "runcell_acquire",
        "runcell_park",
    ]
    limiter.release(holder)
