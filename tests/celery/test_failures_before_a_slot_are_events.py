"""A task that fails before it asks for a slot still emits its failure's event.

A slot request emits ``timed-out``, ``queue-full``, ``limiter-error``...; but a run can
stop earlier: a malformed ``runcell_*`` header, a limiter that cannot be built, a first
start the database cannot record. Those failures are events too (the dashboard's
failures chart and the counters read them), each counted once. The tasks run on an
in-process worker (threads) of an app of the test's own, on Celery's memory broker.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker

from runcell_celery import (
    ConcurrencyConfigError,
    ConcurrencyLimiterError,
    add_event_listener,
    remove_event_listener,
)
from runcell_celery.celery import RunCellTask
from runcell_celery.celery.state import discard_state, state_for
from runcell_celery.events import ConcurrencyEvent

#: A port nothing listens on (privileged, never a test service's).
UNREACHABLE_DSN = "postgresql://postgres@127.0.0.1:1/runcell_nowhere"
TASK = "failures.limited"


class Events:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seen: list[ConcurrencyEvent] = []

    def __call__(self, event: ConcurrencyEvent) -> None:
        with self.lock:
            self.seen.append(event)

    def of(self, run_id: str) -> list[ConcurrencyEvent]:
        with self.lock:
            return [e for e in self.seen if e.run_id == run_id]


@pytest.fixture
def events() -> Iterator[Events]:
    listener = Events()
    add_event_listener(listener)
    yield listener
    remove_event_listener(listener)


def _app(runcell: dict[str, Any]) -> Celery:
    app = Celery("runcell-failures-test", set_as_current=False)
    app.conf.update(
        broker_url="memory://",
        result_backend="cache+memory://",
        task_default_queue="runcell-failures-test",
        runcell=runcell,
    )

    @app.task(
        base=RunCellTask,
        bind=True,
        shared=False,
        name=TASK,
        concurrency={"limiter": "llm", "timeout_ms": 1_500},
    )
    def limited(self: RunCellTask) -> str:
        return "ran"

    app.finalize()
    return app


def _failures(app: Celery) -> int:
    counts = state_for(app).counters.local()
    return sum(c.concurrency_failures for c in counts if c.task_name == TASK)


def test_a_malformed_runcell_header_fails_the_task_with_a_config_error_event(events) -> None:
    app = _app({"BACKEND": "memory", "LIMITERS": {"llm": {"max_concurrent": 1}}})
    try:
        with start_worker(app, pool="threads", perform_ping_check=False):
            result = app.tasks[TASK].apply_async(headers={"runcell_select": ["interactive"]})
            with pytest.raises(ConcurrencyConfigError):
                result.get(timeout=30)
        (event,) = events.of(result.id)
        assert event.type == "config-error"
        assert (event.limiter, event.holder_name) == ("llm", TASK)
        assert "runcell_select" in (event.error or "")
        assert _failures(app) == 1, "counted once: by the listener, not again by the task"
    finally:
        discard_state(app)


@pytest.mark.stress  # a whole-system run of many seconds; CI runs the stress suite too
def test_a_limiter_that_cannot_reach_its_database_fails_the_task_with_a_limiter_error_event(
    events,
) -> None:
    app = _app(
        {
            "DATABASE": UNREACHABLE_DSN,
            "LIMITERS": {"llm": {"max_concurrent": 1}},
            "POSTGRES": {"connect_timeout_ms": 200},
        }
    )
    try:
        with start_worker(app, pool="threads", perform_ping_check=False):
            result = app.tasks[TASK].delay()
            with pytest.raises(ConcurrencyLimiterError):
                result.get(timeout=60)
        found = events.of(result.id)
        assert [e.type for e in found] == ["limiter-error"]
        (event,) = found
        assert (event.limiter, event.holder_name, event.wait_ms) == ("llm", TASK, 0.0)
        assert "ConcurrencyLimiterError" in (event.error or "")
        assert _failures(app) == 1
    finally:
        discard_state(app)
