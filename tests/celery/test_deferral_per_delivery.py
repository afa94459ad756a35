"""A lease belongs to one delivery of a task, never to its task id alone.

Real prefork workers; the fake provider is the independent witness: it counts the
requests it has in flight itself, whatever the limiter believes. Fencing tokens are
read from the ``acquired`` events the workers emitted.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import psycopg
import redis
from celery import Celery
from celery.result import AsyncResult

from runcell_celery.celery import admission_counts, registry_for
from runcell_celery.testing import FakeProvider
from tests.conftest import wait_until
from tests.support.celery_app import REDIS_URL

LIMITS = {
    "max_concurrent": 1,
    "lease_ttl_ms": 5_000,
    "workloads": {"interactive": {}, "background": {}},
    "default_workload": "background",
}


def _idle(queue: str, pg_dsn: str) -> bool:
    """No message of the test's queue is waiting or unacked in the broker, and nothing
    waits, is parked or holds a slot of the limiter."""
    broker = redis.Redis.from_url(REDIS_URL)
    if broker.llen(queue) or broker.hlen(f"{queue}-unacked"):
        return False
    with psycopg.connect(pg_dsn) as conn:
        row = conn.execute(
            "SELECT (SELECT count(*) FROM runcell_queue WHERE limiter = 'llm')"
            " + (SELECT count(*) FROM runcell_lease WHERE limiter = 'llm')"
        ).fetchone()
    return row is not None and row[0] == 0


def _wait_settled(queue: str, pg_dsn: str, timeout: float) -> None:
    """Wait until every delivery has ended: idle twice, a second apart (a message being
    handed from the queue to a worker is briefly in neither list)."""

    def settled() -> bool:
        if not _idle(queue, pg_dsn):
            return False
        time.sleep(1.0)
        return _idle(queue, pg_dsn)

    wait_until(settled, "every delivery ended", timeout, interval=0.1)


def _counts(app: Celery, since: tuple[int, int] = (0, 0)) -> tuple[int, int]:
    """``rc.defer``'s (deliveries, deferrals) as the workers wrote them (about once a
    second), less ``since``: the counts are fleet-wide, earlier tests' included."""
    registry_for(app).get("llm")  # the schema exists once the limiter does
    for count in admission_counts(app):
        if count.task_name == "rc.defer":
            return count.deliveries - since[0], count.deferrals - since[1]
    return -since[0], -since[1]


def _tokens(events: list[dict[str, Any]], task_id: str) -> list[int]:
    return [
        e["fencing_token"] for e in events if e["type"] == "acquired" and e["run_id"] == task_id
    ]


def _check_one_holder_at_a_time(
    provider: FakeProvider, events: list[dict[str, Any]], task_id: str
) -> None:
    witness = provider.stats()
    assert witness.max_in_flight <= 1, f"the provider saw {witness.max_in_flight} in flight"
    assert witness.max_in_flight == 1, "no body ever ran; the test proves nothing"
    tokens = _tokens(events, task_id)
    assert tokens, "no slot was acquired"
    assert len(tokens) == len(set(tokens)), f"two holders shared a fencing token: {tokens}"


def test_the_same_task_id_sent_twice_never_runs_two_bodies_at_once(
    make_app, worker_processes, provider: FakeProvider, pg_dsn: str, celery_settings, worker_events
) -> None:
    settings = {
        **celery_settings,
        "runcell": {**celery_settings["runcell"], "LIMITERS": {"llm": LIMITS}},
    }
    app = make_app(**settings)
    before = _counts(app)
    workers = worker_processes(**settings)
    workers.start(concurrency=2)
    task_id = str(uuid.uuid4())

    first = app.tasks["rc.defer"].apply_async((1_500,), task_id=task_id)
    app.tasks["rc.defer"].apply_async((1_500,), task_id=task_id)

    try:
        first.get(timeout=60)
        _wait_settled(settings["queue"], pg_dsn, 60)
    except Exception:
        print(workers.logs())
        raise
    assert AsyncResult(task_id, app=app).state == "SUCCESS"
    _check_one_holder_at_a_time(provider, worker_events(), task_id)
    # Counts are written about once a second by each worker process.
    wait_until(
        lambda: _counts(app, before)[1] >= 1,
        "the second delivery waited (else the test proves nothing)",
        30,
        interval=0.2,
    )


def test_a_redelivery_after_the_visibility_timeout_waits_for_a_slot_of_its_own(
    make_app, worker_processes, provider: FakeProvider, pg_dsn: str, celery_settings, worker_events
) -> None:
    queue = celery_settings["queue"]
    conf = {
        "broker_transport_options": {
            # The running delivery's message comes back to the queue after 2 s.
            "visibility_timeout": 2,
            "unacked_key": f"{queue}-unacked",
            "unacked_index_key": f"{queue}-unacked-index",
            "unacked_mutex_key": f"{queue}-unacked-mutex",
            "unacked_mutex_expire": 30,
            "unacked_restore_interval": 1,
            "unacked_restore_throttle": 1,
        }
    }
    settings = {
        **celery_settings,
        "runcell": {**celery_settings["runcell"], "LIMITERS": {"llm": LIMITS}},
        "conf": conf,
    }
    app = make_app(**settings)
    before = _counts(app)
    workers = worker_processes(**settings)
    workers.start(concurrency=2)

    result = app.tasks["rc.defer"].apply_async((7_000,))  # runs well past the timeout
    try:
        result.get(timeout=90)
        _wait_settled(queue, pg_dsn, 90)
    except Exception:
        print(workers.logs())
        raise
    assert AsyncResult(result.id, app=app).state == "SUCCESS"
    _check_one_holder_at_a_time(provider, worker_events(), result.id)
    wait_until(
        lambda: _counts(app, before)[0] - _counts(app, before)[1] >= 2,
        "the message was redelivered (else the test proves nothing)",
        30,
        interval=0.2,
    )


def test_a_delivery_of_a_task_that_already_finished_is_dropped_as_a_duplicate(
    make_app, worker_processes, provider: FakeProvider, pg_dsn: str, celery_settings
) -> None:
    settings = {
        **celery_settings,
        "runcell": {**celery_settings["runcell"], "LIMITERS": {"llm": LIMITS}},
    }
    app = make_app(**settings)
    before = _counts(app)
    workers = worker_processes(**settings)
    workers.start(concurrency=2)
    task_id = str(uuid.uuid4())
    try:
        first = app.tasks["rc.defer"].apply_async((20,), task_id=task_id).get(timeout=60)
        # The same task id again: its slot is free, but the task has its result.
        app.tasks["rc.defer"].apply_async((20,), task_id=task_id)
        wait_until(
            lambda: _counts(app, before)[0] >= 2, "the second delivery ran", 30, interval=0.2
        )
        _wait_settled(settings["queue"], pg_dsn, 60)
    except Exception:
        print(workers.logs())
        raise
    assert provider.stats().completed == 1, "the finished task ran again"
    result = AsyncResult(task_id, app=app)
    assert result.state == "SUCCESS"
    assert result.result == first, "the duplicate replaced the first delivery's result"
