"""A parked task granted a slot overtakes a backlog of its queue.

Its re-publication goes to the queue's granted queue (``<queue>.runcell``), which the
worker consumes beside the queue: the worker takes from its queues in turn, so the
granted task starts after a message or two of the backlog, not after all of it, and
its slot does not stay idle meanwhile. Real worker subprocess, real broker (Redis, and
RabbitMQ), real PostgreSQL.

How: the test holds the limiter's only slot; the parked task parks; both of the
worker's consumers are paused; 500 no-op messages are queued; the slot is released
(the worker re-publishes the granted task); the queue is resumed first, then its
granted queue; the test reads how many no-ops ran before the parked task's body
(the rest of the backlog is deleted with the queues).
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis

from runcell_celery import AcquireRequest, LimiterConfig, RunLineage
from runcell_celery.celery.message import granted_queue_name
from runcell_celery.postgres import PostgresBackend
from tests.support.celery_fixtures import WorkerProcesses

from .granted_queue_app import ENV, LIMITS, REDIS_URL, create_app

RABBITMQ_URL = os.environ.get("RUNCELL_TEST_RABBITMQ", "amqp://guest:guest@127.0.0.1:5672//")
BACKLOG = 500


def _rabbitmq_up() -> bool:
    from kombu import Connection

    try:
        with Connection(RABBITMQ_URL, connect_timeout=2) as conn:
            conn.ensure_connection(max_retries=1)
        return True
    except Exception:
        return False


BROKERS = [
    pytest.param(REDIS_URL, id="redis"),
    pytest.param(
        RABBITMQ_URL,
        id="rabbitmq",
        marks=pytest.mark.skipif(not _rabbitmq_up(), reason="no RabbitMQ at 127.0.0.1:5672"),
    ),
]


def _wait(what: str, check: Any, timeout: float = 30) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@contextlib.contextmanager
def _worker(settings: dict[str, Any], log_dir: Path) -> Iterator[str]:
    """One ``celery worker`` subprocess (solo pool) on the test's queue; stopped by PID."""
    workers = WorkerProcesses(settings, log_dir, app="tests.celery.granted_queue_app:app", env=ENV)
    try:
        yield workers.nodename(workers.start(pool="solo"))
    finally:
        workers.stop_all()


def _parked_rows(dsn: str, limiter: str) -> list[tuple[bool, bool]]:
    """(granted, published) of each parked row of ``limiter``."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT granted_lease_id IS NOT NULL, published_at IS NOT NULL FROM runcell_queue "
            "WHERE limiter = %s AND parked",
            [limiter],
        ).fetchall()
    return [(bool(r[0]), bool(r[1])) for r in rows]


@pytest.mark.parametrize("broker", BROKERS)
def test_a_granted_parked_task_overtakes_a_backlog_of_its_queue(
    broker: str, pg_dsn: str, tmp_path: Path
) -> None:
    tag = uuid.uuid4().hex[:10]
    settings = {
        "broker": broker,
        "queue": f"runcell-granted-{tag}",
        "database": pg_dsn,
        "limiter": f"granted-{tag}",
        "records_key": f"runcell-granted-records-{tag}",
    }
    queue, granted = settings["queue"], granted_queue_name(settings["queue"])
    app = create_app(settings)
    sink = redis.Redis.from_url(REDIS_URL)
    backend = PostgresBackend(database=pg_dsn)
    limiter = backend.create_limiter(LimiterConfig.from_mapping(LIMITS, name=settings["limiter"]))
    holder = f"holder-{tag}"
    held = limiter.acquire(
        AcquireRequest(request_id=holder, workload="default", lineage=RunLineage(holder, holder))
    )
    try:
        with _worker(settings, tmp_path) as hostname:
            _wait("the worker", lambda: app.control.ping(destination=[hostname], timeout=0.5))
            result = app.tasks["granted.parked"].apply_async()
            _wait("the task to park", lambda: _parked_rows(pg_dsn, settings["limiter"]))

            for name in (queue, granted):
                replies = app.control.cancel_consumer(
                    name, destination=[hostname], reply=True, timeout=10
                )
                assert replies, f"the worker did not stop consuming {name}"
            with app.producer_or_acquire() as producer:
                for _ in range(BACKLOG):
                    app.tasks["granted.noop"].apply_async(producer=producer)
            limiter.release(held)  # granted to the parked task; the worker re-publishes it
            _wait(
                "the grant's re-publication",
                lambda: _parked_rows(pg_dsn, settings["limiter"]) == [(True, True)],
            )
            assert sink.llen(settings["records_key"]) == 0, "the backlog ran while paused"

            # The backlog's queue first: it has a head start on the granted task.
            app.control.add_consumer(queue, destination=[hostname], reply=True, timeout=10)
            app.control.add_consumer(granted, destination=[hostname], reply=True, timeout=10)
            assert result.get(timeout=60) == "ran"
            records = [r.decode() for r in sink.lrange(settings["records_key"], 0, -1)]
        ran_before = records.index("P")
        assert records.count("P") == 1
        # Taken in turn with the backlog's queue: a few no-ops at most before it (the
        # ones the worker had already reserved), never most of the backlog.
        assert ran_before < BACKLOG // 10, (
            f"the granted task started after {ran_before} of {BACKLOG} backlog messages"
        )
    finally:
        sink.delete(settings["records_key"])
        with app.connection_for_write() as conn:  # what is left of the backlog
            channel = conn.default_channel
            for name in (queue, granted):
                with contextlib.suppress(Exception):
                    channel.queue_delete(name)
        backend.close()
