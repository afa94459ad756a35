"""Fixtures shared by every test directory: a fake clock and an event recorder."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest

from runcell_celery import ConcurrencyEvent, add_event_listener, remove_event_listener
from runcell_celery.celery.counters import FLUSH_INTERVAL_S

#: Upper bound for anything a test expects to happen "soon" in another thread.
SOON_S = 10.0


class FakeClock:
    """A clock that only moves when told to (``advance``); implements ``Clock``."""

    def __init__(self, start: float = 1_000.0, wall: float = 1_700_000_000.0) -> None:
        self._lock = threading.Lock()
        self._start = start
        self._now = start
        self._wall = wall

    def monotonic(self) -> float:
        with self._lock:
            return self._now

    def time(self) -> float:
        with self._lock:
            return self._wall + (self._now - self._start)

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._now += seconds


class EventRecorder:
    """An event listener that keeps every event it receives, from any thread."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.events: list[ConcurrencyEvent] = []

    def __call__(self, event: ConcurrencyEvent) -> None:
        with self._cond:
            self.events.append(event)
            self._cond.notify_all()

    def of(self, type_: str, *, limiter: str | None = None) -> list[ConcurrencyEvent]:
        with self._cond:
            return [
                e
                for e in self.events
                if e.type == type_ and (limiter is None or e.limiter == limiter)
            ]

    def types(self, *, limiter: str | None = None) -> list[str]:
        with self._cond:
            return [e.type for e in self.events if limiter is None or e.limiter == limiter]

    def wait_for(
        self, type_: str, *, limiter: str | None = None, timeout: float = SOON_S
    ) -> ConcurrencyEvent:
        """Return the first event of ``type_``, waiting for it if need be."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                found = [
                    e
                    for e in self.events
                    if e.type == type_ and (limiter is None or e.limiter == limiter)
                ]
                if found:
                    return found[0]
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no {type_!r} event within {timeout} s: {self.events}")
                self._cond.wait(left)


def wait_until(
    check: Callable[[], object], what: str, timeout: float = SOON_S, *, interval: float = 0.002
) -> None:
    """Poll ``check`` every ``interval`` s until it is true; fail naming ``what`` after
    ``timeout``."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(interval)


def settled_counts(
    read: Callable[[], dict[str, int]], ready: Callable[[dict[str, int]], bool], what: str
) -> dict[str, int]:
    """``read()`` once ``ready`` holds of it and two reads a flush interval apart agree.

    Each worker process writes its admission counts in batches, every
    ``FLUSH_INTERVAL_S``: a delivery's count and its deferral's are added a database
    round trip apart and can land in two batches, so one read can see the first
    without the second."""
    wait_until(lambda: ready(read()), what, 30, interval=0.1)
    deadline = time.monotonic() + 30
    counts = read()
    while True:
        time.sleep(FLUSH_INTERVAL_S + 0.5)
        again = read()
        if again == counts:
            return counts
        if time.monotonic() > deadline:
            raise AssertionError(f"the counts never settled: {counts} then {again}")
        counts = again


@pytest.fixture
def fake_clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def events() -> Iterator[EventRecorder]:
    """Record every concurrency event emitted during the test; removed afterwards."""
    recorder = EventRecorder()
    add_event_listener(recorder)
    try:
        yield recorder
    finally:
        remove_event_listener(recorder)


@pytest.fixture
def eventually() -> Callable[..., None]:
    """``eventually(check, what)``: poll a condition another thread will make true."""
    return wait_until
