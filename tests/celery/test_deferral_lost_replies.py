"""Deferred tasks complete exactly once when the replies to parking operations are lost.

Real prefork workers reach PostgreSQL through a
:class:`~tests.support.reply_dropper.ReplyDropper` that loses the reply to park, claim
and complete operations after they committed (the test process talks to the server
directly). A worker that took a lost reply for "nothing happened" would ack a task away
(PENDING for ever) or run it twice; the fake provider counts every run.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from celery.result import AsyncResult

from runcell_celery import ConcurrencyTimeoutError, slot
from runcell_celery.celery import admission_counts, registry_for
from runcell_celery.testing import FakeProvider
from tests.conftest import wait_until
from tests.support.reply_dropper import ReplyDropper

LIMITS = {
    "max_concurrent": 1,
    # Long enough that no grant can expire before its task picks it up, however loaded
    # the machine: each task must park exactly once.
    "lease_ttl_ms": 30_000,
    "workloads": {"interactive": {}, "background": {}},
    "default_workload": "background",
}
PARK, CLAIM, COMPLETE = (
    b"runcell_park(",
    b"runcell_claim(",
    b"runcell_complete_expired(",
)


@pytest.fixture
def dropper(pg_dsn: str) -> Iterator[ReplyDropper]:
    params = psycopg.conninfo.conninfo_to_dict(pg_dsn)
    target = (str(params.get("host") or "127.0.0.1"), int(params.get("port") or 5432))
    with ReplyDropper(target) as proxy:
        yield proxy


def _parked_or_held(pg_dsn: str) -> int:
    with psycopg.connect(pg_dsn) as conn:
        row = conn.execute(
            "SELECT (SELECT count(*) FROM runcell_queue WHERE limiter = 'llm')"
            " + (SELECT count(*) FROM runcell_lease WHERE limiter = 'llm')"
        ).fetchone()
    return int(row[0]) if row else 0


def _waiting(pg_dsn: str) -> int:
    with psycopg.connect(pg_dsn) as conn:
        row = conn.execute(
            "SELECT count(*) FROM runcell_queue WHERE limiter = 'llm' AND parked"
        ).fetchone()
    return int(row[0]) if row else 0


def test_deferred_tasks_complete_exactly_once_when_parking_replies_are_lost(
    make_app,
    worker_processes,
    provider: FakeProvider,
    pg_dsn: str,
    celery_settings,
    dropper: ReplyDropper,
) -> None:
    settings = {
        **celery_settings,
        "runcell": {**celery_settings["runcell"], "LIMITERS": {"llm": LIMITS}},
    }
    app = make_app(**settings)  # the test's own process: direct to the server
    before = _task_counts(app)  # fleet-wide: earlier tests' counts are in them
    proxied = psycopg.conninfo.conninfo_to_dict(pg_dsn)
    proxied.update(host="127.0.0.1", port=str(dropper.port))
    worker_settings = copy.deepcopy(settings)
    worker_settings["runcell"]["DATABASE"] = psycopg.conninfo.make_conninfo(**proxied)
    workers = worker_processes(**worker_settings)
    for marker in (PARK, CLAIM, COMPLETE):
        dropper.arm(marker, times=2)
    workers.start(concurrency=2)

    with slot(registry_for(app).get("llm")):  # every task parks behind this slot
        results = [app.tasks["rc.defer"].apply_async((50,)) for _ in range(5)]
        stale = app.tasks["rc.defer_budget"].apply_async(concurrency={"timeout_ms": 1_500})
        try:
            # Its budget ends while it is parked: the sweeper fails it, losing a reply.
            with pytest.raises(ConcurrencyTimeoutError):
                stale.get(timeout=60)
            wait_until(lambda: _waiting(pg_dsn) == 5, "the others are parked", 60, interval=0.1)
        except BaseException:
            print(workers.logs())
            raise
    try:
        replies = [result.get(timeout=60) for result in results]
        wait_until(lambda: _parked_or_held(pg_dsn) == 0, "nothing parked or held", 30)
    except BaseException:
        print(workers.logs())
        raise

    for marker in (PARK, CLAIM, COMPLETE):
        assert dropper.dropped[marker] >= 1, f"no reply to {marker!r} was lost; proves nothing"
    assert len(replies) == 5
    assert {AsyncResult(r.id, app=app).state for r in results} == {"SUCCESS"}
    assert AsyncResult(stale.id, app=app).state == "FAILURE"
    witness = provider.stats()
    assert witness.completed == 5, f"{witness.completed} provider calls for 5 tasks"
    assert witness.max_in_flight == 1
    wait_until(
        lambda: _task_counts(app, before)[2] >= 1,
        "the stale task counted as a concurrency failure",
        30,
        interval=0.2,
    )
    # Each task parked once and ran from its one re-publication: a retry that read its
    # own claim as "gone" would have left the lease unused and parked the task again.
    wait_until(
        lambda: _task_counts(app, before)[0] >= 10, "the deliveries are counted", 30, interval=0.2
    )
    assert _task_counts(app, before) == (10, 5, 1)


def _task_counts(app: Any, since: tuple[int, int, int] = (0, 0, 0)) -> tuple[int, int, int]:
    """``rc.defer``'s deliveries and deferrals and ``rc.defer_budget``'s concurrency
    failures, as the workers wrote them, less ``since``."""
    registry_for(app).get("llm")  # the schema exists once the limiter does
    counts = {c.task_name: c for c in admission_counts(app)}
    defer, budget = counts.get("rc.defer"), counts.get("rc.defer_budget")
    return (
        (defer.deliveries if defer else 0) - since[0],
        (defer.deferrals if defer else 0) - since[1],
        (budget.concurrency_failures if budget else 0) - since[2],
    )
