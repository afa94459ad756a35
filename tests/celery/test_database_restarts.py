"""A database restart fails no task whose budget outlasts it.

The limiter database here is a PostgreSQL server of the test's own
(:class:`~tests.support.throwaway_cluster.ThrowawayCluster`), restarted and stopped
with ``pg_ctl`` under a real prefork worker while tasks keep arriving; the broker and
the result backend are the shared Redis, which stays up. Every task's result is read
from the result backend.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery
from celery.result import AsyncResult

from tests.support.throwaway_cluster import ThrowawayCluster, throwaway_cluster

__all__ = ["throwaway_cluster"]

#: Each task's budget (``timeout_ms``): far longer than any outage here.
BUDGET_MS = 45_000
#: Tasks of both admission modes: ``rc.wait`` blocks for its slot, ``rc.defer`` parks.
TASKS = ("rc.wait", "rc.defer")


def _on_cluster(settings: dict[str, Any], cluster: ThrowawayCluster) -> dict[str, Any]:
    return {**settings, "runcell": {**settings["runcell"], "DATABASE": cluster.dsn}}


def _send(app: Celery, i: int) -> AsyncResult[Any]:
    task = app.tasks[TASKS[i % len(TASKS)]]
    return task.apply_async((20,), concurrency={"timeout_ms": BUDGET_MS})


def _outcomes(app: Celery, results: list[AsyncResult[Any]], timeout: float) -> dict[str, str]:
    """Each task's final state in the result backend (``FAILURE: <error>`` for a failure)."""
    states: dict[str, str] = {}
    end = time.monotonic() + timeout
    for result in results:
        with contextlib.suppress(Exception):  # a timeout: the state below says PENDING
            result.get(timeout=max(0.1, end - time.monotonic()), propagate=False)
        stored = AsyncResult(result.id, app=app)
        state = stored.state
        states[result.id] = f"FAILURE: {stored.result!r}" if state == "FAILURE" else state
    return states


def _keep_sending(app: Celery, sent: list[AsyncResult[Any]], stop: threading.Event) -> None:
    i = 0
    while not stop.is_set():
        sent.append(_send(app, i))
        i += 1
        stop.wait(0.1)


@pytest.mark.stress  # a whole-system run of many seconds; CI runs the stress suite too
def test_tasks_arriving_while_the_database_restarts_and_goes_down_for_seconds_all_succeed(
    make_app: Callable[..., Celery],
    worker_processes: Any,
    celery_settings: dict[str, Any],
    throwaway_cluster: ThrowawayCluster,
) -> None:
    settings = _on_cluster(celery_settings, throwaway_cluster)
    app = make_app(**settings)
    workers = worker_processes(**settings)
    workers.start(concurrency=4, answering=app)
    sent: list[AsyncResult[Any]] = []
    stop = threading.Event()
    sender = threading.Thread(target=_keep_sending, args=(app, sent, stop), daemon=True)
    try:
        # Warm workers: every pool process has its limiters and connections.
        warm = [_send(app, i) for i in range(8)]
        assert set(_outcomes(app, warm, 60).values()) == {"SUCCESS"}, workers.logs()
        sender.start()
        time.sleep(1)
        throwaway_cluster.restart()  # what an operator does: a blip of a fraction of a second
        time.sleep(1.5)
        throwaway_cluster.stop()  # and an outage of a few seconds
        time.sleep(4)
        throwaway_cluster.start()
        time.sleep(2)
    finally:
        stop.set()
        sender.join(10)
        if not throwaway_cluster.running():
            throwaway_cluster.start()
    outcomes = _outcomes(app, sent, 90)
    failed = {task_id: state for task_id, state in outcomes.items() if state != "SUCCESS"}
    assert len(sent) > 50
    assert failed == {}, workers.logs()


@pytest.mark.stress  # a whole-system run of many seconds; CI runs the stress suite too
def test_tasks_sent_while_the_database_is_down_at_worker_start_succeed_once_it_is_up(
    make_app: Callable[..., Celery],
    worker_processes: Any,
    celery_settings: dict[str, Any],
    throwaway_cluster: ThrowawayCluster,
) -> None:
    settings = _on_cluster(celery_settings, throwaway_cluster)
    app = make_app(**settings)
    workers = worker_processes(**settings)
    throwaway_cluster.stop()
    try:
        workers.start(concurrency=4, answering=app)  # with no database at all
        started = time.monotonic()
        sent = [_send(app, i) for i in range(12)]
        time.sleep(max(0.0, 10 - (time.monotonic() - started)))
        assert all(AsyncResult(r.id, app=app).state != "FAILURE" for r in sent), workers.logs()
    finally:
        if not throwaway_cluster.running():
            throwaway_cluster.start()
    sent.append(_send(app, 0))  # and one sent once it is up
    outcomes = _outcomes(app, sent, 60)
    failed = {task_id: state for task_id, state in outcomes.items() if state != "SUCCESS"}
    assert failed == {}, workers.logs()
    assert workers.procs[0].poll() is None, "the worker stopped"


@pytest.fixture(autouse=True)
def _cluster_left_running(throwaway_cluster: ThrowawayCluster) -> None:
    """Each test starts with the cluster up, whatever an earlier one left."""
    if not throwaway_cluster.running():
        throwaway_cluster.start()
