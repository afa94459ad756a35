"""Parked work never vanishes: it runs, or it fails visibly in the result backend.

The broker and the result backend here are ``redis-server`` processes of the test's
own (:class:`~tests.support.redis_server.RedisServer`), stopped and restarted by PID.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from celery.result import AsyncResult
from celery.signals import task_failure

from runcell_celery import (
    AcquireRequest,
    ConcurrencyEvent,
    ConcurrencyTimeoutError,
    Member,
    RunLineage,
    add_event_listener,
    remove_event_listener,
    slot,
)
from runcell_celery.celery import registry_for
from runcell_celery.celery.deferral import Sweeper
from runcell_celery.celery.message import DeliveredMessage
from runcell_celery.celery.state import state_for
from runcell_celery.ports import Parked
from runcell_celery.postgres import PostgresConcurrencyLimiter
from tests.conftest import wait_until
from tests.support.pg import unique_name
from tests.support.redis_server import RedisServer

LIMITS = {
    "max_concurrent": 1,
    "lease_ttl_ms": 5_000,
    "workloads": {"interactive": {}, "background": {}},
    "default_workload": "background",
}


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _stored(pg_dsn: str, request_ids: list[str] | None = None) -> int:
    """Rows of the limiter's queue (those of ``request_ids``, or the parked ones)."""
    with psycopg.connect(pg_dsn) as conn:
        if request_ids is None:
            query = "SELECT count(*) FROM runcell_queue WHERE limiter = 'llm' AND parked"
            row = conn.execute(query).fetchone()
        else:
            query = "SELECT count(*) FROM runcell_queue WHERE request_id = ANY(%s)"
            row = conn.execute(query, [request_ids]).fetchone()
    return int(row[0]) if row else 0


def test_a_budget_that_ends_while_the_broker_is_down_fails_visibly_and_the_others_run(
    make_app, worker_processes, pg_dsn: str, celery_settings, own_redis: RedisServer
) -> None:
    settings = {
        **celery_settings,
        "runcell": {**celery_settings["runcell"], "LIMITERS": {"llm": LIMITS}},
        "conf": {"broker_url": own_redis.url},  # results stay on the shared Redis
    }
    app = make_app(**settings)
    workers = worker_processes(**settings)
    workers.start(concurrency=2)

    try:
        with slot(registry_for(app).get("llm")):  # every task parks behind this slot
            results = [app.tasks["rc.defer"].apply_async((20,)) for _ in range(3)]
            stale = app.tasks["rc.defer_budget"].apply_async(concurrency={"timeout_ms": 3_000})
            wait_until(lambda: _stored(pg_dsn) == 4, "all four are parked", 60, interval=0.1)
            own_redis.stop()
            # The stale one's budget ends during the outage; its failure needs no broker.
            wait_until(
                lambda: AsyncResult(stale.id, app=app).state == "FAILURE",
                "the stale task failed",
                60,
                interval=0.2,
            )
        # The slot frees while the broker is still down: its grant cannot be published.
        wait_until(lambda: _stored(pg_dsn) == 3, "the stale row is deleted", 30, interval=0.1)
        own_redis.start()
        replies = [result.get(timeout=120) for result in results]
    except BaseException:
        print(workers.logs())
        raise

    assert len(replies) == 3
    assert {AsyncResult(r.id, app=app).state for r in results} == {"SUCCESS"}
    with pytest.raises(ConcurrencyTimeoutError):
        stale.get(timeout=10)
    assert _stored(pg_dsn) == 0


def test_a_stale_parked_task_stays_stored_while_the_result_backend_is_down(
    make_app, pg_dsn: str, own_redis: RedisServer
) -> None:
    app = make_app(
        limits=LIMITS,
        conf={
            "result_backend": own_redis.url,
            # Fail fast while it is down (the sweeper tries again at its next pass).
            "result_backend_transport_options": {"retry_policy": {"max_retries": 1}},
        },
    )
    registry = registry_for(app)
    limiter = registry.get("llm")
    assert isinstance(limiter, PostgresConcurrencyLimiter)
    failures: list[tuple[str, tuple[Any, ...]]] = []
    events: list[ConcurrencyEvent] = []

    def on_failure(task_id: str, args: tuple[Any, ...], **_: Any) -> None:
        failures.append((task_id, tuple(args)))

    task_failure.connect(on_failure, weak=False)
    add_event_listener(events.append)
    try:
        holder = unique_name("holder")
        held = limiter.acquire(AcquireRequest(holder, "background", RunLineage(holder, holder)))
        task_id = str(uuid.uuid4())
        request_id = f"{task_id}/{uuid.uuid4().hex}"
        request = AcquireRequest(
            request_id,
            "background",
            RunLineage(task_id, task_id),
            timeout_ms=50,
            holder_name="rc.defer_budget",
        )
        body = json.dumps([[7], {}, {"callbacks": None, "errbacks": None, "chain": None}])
        message = DeliveredMessage(
            body=body.encode(),
            content_type="application/json",
            content_encoding="utf-8",
            headers={"id": task_id, "task": "rc.defer_budget", "root_id": task_id},
            properties={"correlation_id": task_id},
            exchange="",
            routing_key="runcell-test",
        )
        parked = limiter.acquire_or_park(
            [Member(limiter, request)], admission_wait_ms=0, payload=message.to_payload()
        )
        assert isinstance(parked, Parked)
        sweeper = Sweeper(app, registry)  # its passes are run here, not by its loop
        own_redis.stop()
        wait_until(lambda: _past_deadline(pg_dsn, request_id), "its deadline passed", 10)

        assert sweeper.fail_expired() == 0, "a failure was recorded with the backend down"
        assert _stored(pg_dsn, [request_id]) == 1, "the row went before its failure was recorded"
        assert failures == []

        own_redis.start()
        assert sweeper.fail_expired() == 1
        assert _stored(pg_dsn, [request_id]) == 0
        result = AsyncResult(task_id, app=app)
        assert result.state == "FAILURE"
        assert isinstance(result.result, ConcurrencyTimeoutError)
        assert failures == [(task_id, (7,))]
        assert [e.type for e in events if e.run_id == task_id] == ["timed-out"]
        counted = {
            (c.task_name, c.limiter): c.concurrency_failures
            for c in state_for(app).counters.local()
        }
        assert counted.get(("rc.defer_budget", "llm")) == 1
        assert sweeper.fail_expired() == 0, "failed twice"
        limiter.release(held)
    finally:
        task_failure.disconnect(on_failure)
        remove_event_listener(events.append)


def _past_deadline(pg_dsn: str, request_id: str) -> bool:
    with psycopg.connect(pg_dsn) as conn:
        row = conn.execute(
            "SELECT deadline <= clock_timestamp() FROM runcell_queue WHERE request_id = %s",
            [request_id],
        ).fetchone()
    return bool(row and row[0])
