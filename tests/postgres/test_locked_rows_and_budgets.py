"""A request whose limiter rows stay locked by another transaction ends within its own
budget: it withdraws only what it wrote, and a withdrawal that must wait for the rows
goes on in the background instead of holding up the caller."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import psycopg
import pytest

from runcell_celery import ConcurrencyTimeoutError, run, slot
from runcell_celery.postgres import PostgresConcurrencyLimiter

MakeLimiter = Callable[..., PostgresConcurrencyLimiter]

#: The budget of each timed request, and how far past it the caller may return: the
#: withdrawal's 100 ms wait for the rows, plus scheduling on a loaded 2-core CI machine
#: (2.24 s was seen with three test workers). A locked row used to cost 12 s.
BUDGET_MS = 2_000
ENDS_WITHIN_S = 2.5


@contextlib.contextmanager
def rows_locked(dsn: str, names: Sequence[str]) -> Iterator[None]:
    """Hold the limiter rows of ``names`` locked (``SELECT ... FOR UPDATE``) from
    another connection's transaction until the block ends."""
    with psycopg.connect(dsn) as conn:
        locked = conn.execute(
            "SELECT name FROM runcell_limiter WHERE name = ANY(%s) FOR UPDATE", [list(names)]
        ).fetchall()
        assert sorted(r[0] for r in locked) == sorted(names)
        try:
            yield
        finally:
            conn.rollback()


def queue_rows(dsn: str, names: Sequence[str]) -> list[str]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT request_id FROM runcell_queue WHERE limiter = ANY(%s)", [list(names)]
        ).fetchall()
    return [r[0] for r in rows]


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.02)


def timed_out_after(*limiters: PostgresConcurrencyLimiter) -> float:
    """Ask for a slot in ``limiters`` with a budget of BUDGET_MS; seconds until it failed."""
    started = time.monotonic()
    with pytest.raises(ConcurrencyTimeoutError), run(timeout_ms=BUDGET_MS), slot(*limiters):
        pass  # pragma: no cover - never entered
    return time.monotonic() - started


def assert_working_and_empty(dsn: str, *limiters: PostgresConcurrencyLimiter) -> None:
    names = [x.name for x in limiters]
    wait_for(lambda: queue_rows(dsn, names) == [], "the queues emptied")
    with run(timeout_ms=5_000), slot(*limiters):
        assert [x.stats().active for x in limiters] == [1] * len(limiters)
    assert [(x.stats().active, x.stats().queued) for x in limiters] == [(0, 0)] * len(limiters)
    assert queue_rows(dsn, names) == []


def test_a_request_over_two_limiters_whose_rows_stay_locked_ends_within_its_budget(
    pg_dsn: str, make_limiter: MakeLimiter
) -> None:
    a = make_limiter(max_concurrent=1)
    b = make_limiter(max_concurrent=1)
    with rows_locked(pg_dsn, [a.name, b.name]):
        elapsed = timed_out_after(a, b)
    assert elapsed < ENDS_WITHIN_S, f"a {BUDGET_MS} ms budget ended after {elapsed:.2f} s"
    assert_working_and_empty(pg_dsn, a, b)


def test_a_request_over_one_limiter_whose_row_stays_locked_ends_within_its_budget(
    pg_dsn: str, make_limiter: MakeLimiter
) -> None:
    a = make_limiter(max_concurrent=1)
    with rows_locked(pg_dsn, [a.name]):
        elapsed = timed_out_after(a)
    assert elapsed < ENDS_WITHIN_S, f"a {BUDGET_MS} ms budget ended after {elapsed:.2f} s"
    assert_working_and_empty(pg_dsn, a)


@pytest.mark.parametrize("several", [False, True], ids=["one limiter", "two limiters"])
def test_a_waiting_request_whose_rows_are_locked_at_its_deadline_ends_within_its_budget(
    pg_dsn: str, make_limiter: MakeLimiter, several: bool
) -> None:
    a = make_limiter(max_concurrent=1)
    b = make_limiter(max_concurrent=1)
    limiters = (a, b) if several else (a,)
    names = [x.name for x in limiters]
    elapsed: list[float] = []
    with slot(a):  # the request queues behind this holder
        waiter = threading.Thread(target=lambda: elapsed.append(timed_out_after(*limiters)))
        waiter.start()
        wait_for(lambda: a.stats().queued == 1, "the request queued")
        # Locked before its deadline and past it: its withdrawal cannot run in time.
        with rows_locked(pg_dsn, names):
            waiter.join(10)
            assert elapsed, "the request did not end"
            assert elapsed[0] < ENDS_WITHIN_S, (
                f"a {BUDGET_MS} ms budget ended after {elapsed[0]:.2f} s"
            )
    # Once the rows are free its place goes (withdrawn in the background).
    assert_working_and_empty(pg_dsn, *limiters)
