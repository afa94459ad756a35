"""A broker outage while tasks are parked: the worker lives, every parked task runs.

The broker is a ``redis-server`` of the test's own
(:class:`~tests.support.redis_server.RedisServer`), stopped and started again on the
same port by its PID; results go to the shared Redis, so they outlive the outage. The
transport's ``visibility_timeout`` is an hour: a task that finished only because Redis
restored an unacked message would take that long, so finishing within a minute shows
none waited for it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from celery.result import AsyncResult

from runcell_celery.celery.state import state_for
from tests.conftest import wait_until
from tests.support.celery_app import celery_conf
from tests.support.redis_server import RedisServer

LIMITS = {
    "max_concurrent": 1,
    "lease_ttl_ms": 5_000,
    "workloads": {"interactive": {}, "background": {}},
    "default_workload": "background",
}

#: Longer than any wait in this test: a delivery restored by Redis after its
#: visibility timeout would never finish within the test's bounds.
VISIBILITY_TIMEOUT_S = 3_600
#: How long the broker stays down.
OUTAGE_S = 5.0
#: Every task must be done this long after the broker is back.
DONE_WITHIN_S = 60.0


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _broker_settings(celery_settings: dict[str, Any], own_redis: RedisServer) -> dict[str, Any]:
    """The test's settings with the broker on ``own_redis`` (visibility timeout one
    hour); results stay on the shared Redis."""
    options = celery_conf(celery_settings)["broker_transport_options"]
    return {
        **celery_settings,
        "runcell": {**celery_settings["runcell"], "LIMITERS": {"llm": LIMITS}},
        "conf": {
            "broker_url": own_redis.url,
            "broker_transport_options": {**options, "visibility_timeout": VISIBILITY_TIMEOUT_S},
        },
    }


def _parked(pg_dsn: str) -> int:
    with psycopg.connect(pg_dsn) as conn:
        row = conn.execute(
            "SELECT count(*) FROM runcell_queue WHERE limiter = 'llm' AND parked"
        ).fetchone()
    return int(row[0]) if row else 0


def test_a_worker_outlives_a_broker_outage_while_tasks_are_parked_and_runs_every_one(
    make_app, worker_processes, pg_dsn: str, celery_settings, own_redis: RedisServer
) -> None:
    settings = _broker_settings(celery_settings, own_redis)
    app = make_app(**settings)
    workers = worker_processes(**settings)
    worker = workers.start(concurrency=2)

    try:
        # A slow holder takes the one slot; seven more park behind it.
        holder = app.tasks["rc.defer"].apply_async((3_000,))
        wait_until(
            lambda: state_for(app).registry.get("llm").stats().active == 1,
            "the holder runs",
            60,
            interval=0.05,
        )
        parked = [app.tasks["rc.defer"].apply_async((50,)) for _ in range(7)]
        wait_until(lambda: _parked(pg_dsn) == 7, "seven are parked", 60, interval=0.05)

        # The holder's slot frees while the broker is down: its grant cannot be sent.
        own_redis.stop()
        time.sleep(OUTAGE_S)
        assert worker.poll() is None, "the worker died while the broker was down"
        own_redis.start()
        back = time.monotonic()

        results = [holder, *parked]
        wait_until(
            lambda: all(AsyncResult(r.id, app=app).ready() for r in results) or worker.poll(),
            "every task is done",
            DONE_WITHIN_S,
            interval=0.2,
        )
        took = time.monotonic() - back
        states = [AsyncResult(r.id, app=app).state for r in results]
        alive = worker.poll() is None
        left = _parked(pg_dsn)
    except BaseException:
        print(workers.logs())
        raise

    assert alive, f"the worker exited ({worker.returncode}):\n{workers.logs()}"
    assert states == ["SUCCESS"] * 8, states
    assert left == 0
    assert took < DONE_WITHIN_S
