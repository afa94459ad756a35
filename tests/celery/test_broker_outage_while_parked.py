"""A broker outage while tasks are parked: the worker lives, every parked task runs.

The broker is a ``redis-server`` of the test's own
(:class:`~tests.support.redis_server.RedisServer`), stopped and started again on the
same port by its PID; results go to the shared Redis, so they outlive the outage. The
transport's ``visibility_timeout`` is an hour: a task that finished only because Redis
restored an unacked message would take that long, so finishing within a minute shows
none waited for it.
"""

from __future__ import annotations

import json
import statistics
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis
from celery.result import AsyncResult

from runcell_celery import AcquireRequest, Member, RunLineage, slot
from runcell_celery.celery.deferral import Sweeper
from runcell_celery.celery.message import DeliveredMessage
from runcell_celery.celery.state import state_for
from runcell_celery.celery.wiring import ensure_wired
from runcell_celery.ports import Parked
from tests.conftest import wait_until
from tests.support.celery_app import celery_conf
from tests.support.pg import create_database, drop_database
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
def own_database() -> Iterator[str]:
    """A limiter database of the test's own: the grants it leaves in a broker that is
    gone would otherwise stay parked in the module's database, beside later tests'."""
    dsn = create_database("runcell_broker_outage")
    try:
        yield dsn
    finally:
        drop_database(dsn)


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _broker_settings(
    celery_settings: dict[str, Any], own_redis: RedisServer, database: str
) -> dict[str, Any]:
    """The test's settings with the broker on ``own_redis`` (visibility timeout one
    hour) and the limiters on ``database``; results stay on the shared Redis."""
    options = celery_conf(celery_settings)["broker_transport_options"]
    return {
        **celery_settings,
        "runcell": {
            **celery_settings["runcell"],
            "DATABASE": database,
            "LIMITERS": {"llm": LIMITS},
        },
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
    make_app, worker_processes, own_database: str, celery_settings, own_redis: RedisServer
) -> None:
    settings = _broker_settings(celery_settings, own_redis, own_database)
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
        wait_until(lambda: _parked(own_database) == 7, "seven are parked", 60, interval=0.05)

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
        left = _parked(own_database)
    except BaseException:
        print(workers.logs())
        raise

    assert alive, f"the worker exited ({worker.returncode}):\n{workers.logs()}"
    assert states == ["SUCCESS"] * 8, states
    assert left == 0
    assert took < DONE_WITHIN_S


#: Limiters of one slot each: every sample of slot exit time grants a parked request
#: on a limiter of its own.
SAMPLES = 5


def _parked_message(app: Any, task_id: str) -> str:
    body = json.dumps([[5], {}, {"callbacks": None, "errbacks": None, "chain": None}])
    return DeliveredMessage(
        body=body.encode(),
        content_type="application/json",
        content_encoding="utf-8",
        headers={"id": task_id, "task": "rc.defer", "root_id": task_id},
        properties={"correlation_id": task_id},
        exchange="",
        routing_key=app.conf.task_default_queue,
        queue=app.conf.task_default_queue,
    ).to_payload()


def _exit_time(limiter: Any, app: Any) -> tuple[float, str]:
    """Hold ``limiter``'s one slot, park a request behind it, and time the slot's exit
    (which grants the parked request); return the time and the parked task's id."""
    task_id = str(uuid.uuid4())
    request_id = f"{task_id}/{uuid.uuid4().hex}"
    request = AcquireRequest(
        request_id, "background", RunLineage(task_id, task_id), holder_name="rc.defer"
    )
    block = slot(limiter)
    block.__enter__()
    parked = limiter.acquire_or_park(
        [Member(limiter, request)], admission_wait_ms=0, payload=_parked_message(app, task_id)
    )
    assert isinstance(parked, Parked), parked
    started = time.perf_counter()
    block.__exit__(None, None, None)
    return time.perf_counter() - started, task_id


def _published(server: RedisServer, queue: str) -> set[str]:
    """The task ids of the messages waiting in ``queue``'s granted queue."""
    client = redis.Redis(host="127.0.0.1", port=server.port)
    raw = client.lrange(f"{queue}.runcell", 0, -1)
    return {json.loads(item)["headers"]["id"] for item in raw}


def test_a_slot_exit_does_no_broker_io_and_its_grant_is_sent_once_the_broker_returns(
    make_app, celery_settings, own_redis: RedisServer, own_database: str
) -> None:
    """Slot exits are timed with the broker up, stopped (connections refused) and
    paused (SIGSTOP: connections hang until the transport's socket timeout), in this
    process as in a prefork child (no sweeper yet); each grant made while the broker
    is down is sent once it is back (here by the sweeper's next pass)."""
    limits = {f"llm{i}": LIMITS for i in range(3 * SAMPLES)}
    settings = _broker_settings(celery_settings, own_redis, own_database)
    options = settings["conf"]["broker_transport_options"]
    settings["conf"]["broker_transport_options"] = {
        **options,
        "socket_timeout": 1,
        "socket_connect_timeout": 1,
    }
    app = make_app(**{**settings, "runcell": {**settings["runcell"], "LIMITERS": limits}})
    state = ensure_wired(app)
    registry = state.registry
    queue = app.conf.task_default_queue
    # A worker's sweeper, started once the exits are timed: its wake-up handler (on the
    # listener thread) would race the releases for their grants.
    sweeper = Sweeper(app, registry, state.publisher)

    def exits(first: int) -> list[tuple[float, str]]:
        return [_exit_time(registry.get(f"llm{first + i}"), app) for i in range(SAMPLES)]

    def all_sent(samples: list[tuple[float, str]], what: str) -> None:
        tasks = {task_id for _, task_id in samples}
        wait_until(lambda: tasks <= _published(own_redis, queue), what, 30, interval=0.1)

    try:
        up = exits(0)
        all_sent(up, "the grants made with the broker up are sent")
        own_redis.stop()
        stopped = exits(SAMPLES)
        own_redis.start()
        own_redis.pause()
        try:
            paused = exits(2 * SAMPLES)
        finally:
            own_redis.resume()
        sweeper.start()
        all_sent(stopped + paused, "the grants made with the broker down are sent once it is back")
    finally:
        sweeper.stop(5)
        redis.Redis(host="127.0.0.1", port=own_redis.port).delete(f"{queue}.runcell")

    medians = {
        name: statistics.median(t for t, _ in samples)
        for name, samples in (("up", up), ("stopped", stopped), ("paused", paused))
    }
    # The same work whatever the broker does: a database round trip, no broker call.
    assert medians["stopped"] < 10 * medians["up"], medians
    assert medians["paused"] < 10 * medians["up"], medians
