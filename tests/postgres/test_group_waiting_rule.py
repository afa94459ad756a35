"""The several-limiter waiting rule in PostgreSQL (docs/slots.md, "Several limits
and keys"): a request over ``[a, b]`` holds no capacity while it waits, is served at its
place once only one of its limiters lacks room, and is not starved: past
``GROUP_AGEING_MS`` its slots are set aside as they free."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from importlib import resources

import pytest

from runcell_celery import CancellationToken, ConcurrencyTimeoutError, allocation, run, slot
from runcell_celery.postgres import PostgresConcurrencyLimiter

MakeLimiter = Callable[..., PostgresConcurrencyLimiter]

#: ``runcell_celery.allocation.GROUP_AGEING_MS`` (2,000 ms; schema.sql writes it as 2000).
GROUP_AGEING_MS: int = getattr(allocation, "GROUP_AGEING_MS", 2_000)
#: How long each churning thread holds ``a``.
HOLD_S = 0.05
#: Scheduling slack on a machine two other suites share.
SLACK_S = 1.5


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.005)


class Churn:
    """Threads taking ``limiter`` one after another, each holding it ``HOLD_S``."""

    def __init__(self, limiter: PostgresConcurrencyLimiter, threads: int) -> None:
        self.stop = threading.Event()
        self.cycles = 0
        self.failures: list[BaseException] = []
        self._lock = threading.Lock()
        self.threads = [
            threading.Thread(target=self._loop, args=(limiter,), name=f"churn-{i}")
            for i in range(threads)
        ]

    def _loop(self, limiter: PostgresConcurrencyLimiter) -> None:
        try:
            while not self.stop.is_set():
                with run(timeout_ms=30_000), slot(limiter):
                    time.sleep(HOLD_S)
                with self._lock:
                    self.cycles += 1
        except BaseException as exc:  # pragma: no cover - reported by the test
            self.failures.append(exc)

    def __enter__(self) -> Churn:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(30)
        assert not any(thread.is_alive() for thread in self.threads), "a churner hangs"
        assert self.failures == []


class GroupWaiter:
    """A thread waiting for ``slot(*limiters)``; ``granted_at`` once it has it."""

    def __init__(self, *limiters: PostgresConcurrencyLimiter) -> None:
        self.cancel = CancellationToken()
        self.granted_at: float | None = None
        self.failures: list[BaseException] = []
        self.thread = threading.Thread(target=self._wait, args=limiters, name="group")
        self.thread.start()

    def _wait(self, *limiters: PostgresConcurrencyLimiter) -> None:
        try:
            with run(timeout_ms=60_000, cancel=self.cancel), slot(*limiters):
                self.granted_at = time.monotonic()
        except BaseException as exc:  # pragma: no cover - reported by the test
            self.failures.append(exc)

    def wait_granted(self) -> float:
        """Wait until it is granted; when it was (monotonic seconds)."""
        wait_for(lambda: self.granted_at is not None, "[a, b] granted", timeout=30)
        assert self.granted_at is not None
        return self.granted_at

    def join(self) -> None:
        self.thread.join(30)
        assert not self.thread.is_alive()
        assert self.failures == []


def test_a_request_on_a_alone_is_granted_at_once_and_a_b_is_granted_within_its_bound_under_churn(
    make_limiter: MakeLimiter,
) -> None:
    a = make_limiter(max_concurrent=1)
    b = make_limiter(max_concurrent=1)
    holder = slot(b)
    holder.__enter__()  # b is full, a is free
    group = GroupWaiter(a, b)
    wait_for(lambda: (a.stats().queued, b.stats().queued) == (1, 1), "[a, b] waits in both")
    assert group.granted_at is None

    # It holds nothing while it waits for b: a request on `a` alone is served at once,
    # although the first waiter in a's line is [a, b].
    asked = time.monotonic()
    with run(timeout_ms=1_000), slot(a):
        assert time.monotonic() - asked < 1.0
        assert a.stats().active == 1
    assert group.granted_at is None

    with Churn(a, threads=3) as churn:
        wait_for(lambda: churn.cycles >= 6, "a churns")
        freed = time.monotonic()
        holder.__exit__(None, None, None)  # b frees while a is taken over and over
        waited = group.wait_granted() - freed
        bound = GROUP_AGEING_MS / 1000 + HOLD_S + SLACK_S
        assert waited < bound, f"[a, b] waited {waited:.2f} s after b freed (bound {bound} s)"
    group.join()
    assert (a.stats().active, b.stats().active, a.stats().queued, b.stats().queued) == (0, 0, 0, 0)


def test_a_request_lacking_room_in_its_two_limiters_alternately_is_granted_once_aged(
    make_limiter: MakeLimiter,
) -> None:
    # a and b are each taken over and over, one thread holding while another waits:
    # neither is ever free while the other is. Only ageing lets [a, b] through.
    a = make_limiter(max_concurrent=1)
    b = make_limiter(max_concurrent=1)
    with Churn(a, threads=2) as churn_a, Churn(b, threads=2) as churn_b:
        wait_for(lambda: churn_a.cycles >= 4 and churn_b.cycles >= 4, "a and b churn")
        asked = time.monotonic()
        group = GroupWaiter(a, b)
        waited = group.wait_granted() - asked
        bound = GROUP_AGEING_MS / 1000 + 2 * HOLD_S + SLACK_S
        assert waited < bound, f"[a, b] waited {waited:.2f} s (bound {bound} s)"
    group.join()


def test_an_aged_request_keeps_the_slot_it_has_room_for(make_limiter: MakeLimiter) -> None:
    shared = make_limiter(max_concurrent=2)
    busy = make_limiter(max_concurrent=1)
    holder = slot(busy)
    holder.__enter__()
    group = GroupWaiter(shared, busy)
    try:
        wait_for(lambda: busy.stats().queued == 1, "[shared, busy] waits")
        with run(timeout_ms=1_000), slot(shared):  # not aged: it holds nothing
            pass
        time.sleep(GROUP_AGEING_MS / 1000 + 0.2)
        with slot(shared):
            # Aged: the second slot of `shared` is set aside for it.
            asked = time.monotonic()
            with pytest.raises(ConcurrencyTimeoutError), run(timeout_ms=300), slot(shared):
                raise AssertionError("took the slot set aside for [shared, busy]")
            assert time.monotonic() - asked >= 0.25
    finally:
        holder.__exit__(None, None, None)
    group.wait_granted()
    group.join()


def test_the_sql_ages_requests_after_group_ageing_ms() -> None:
    text = resources.files("runcell_celery.postgres").joinpath("schema.sql").read_text()
    literal = re.findall(
        r"-- (\d+): GROUP_AGEING_MS of runcell_celery\.allocation\.\n"
        r"\s+IF p_enqueued_at <= p_now - (\d+) \* interval",
        text,
    )
    assert literal == [(str(GROUP_AGEING_MS), str(GROUP_AGEING_MS))]
