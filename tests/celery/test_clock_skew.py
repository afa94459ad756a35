"""Waits and budgets follow the database's clock, whatever a worker host's clock says.

Hosts' wall clocks drift apart from the database's (and from each other); a worker
that decided by its own ``time.time()`` would give up at once or wait minutes too
long. These workers run with ``time.time`` two minutes ahead of or behind the real
clock (``clock_skew_s``, applied when the worker imports the test app), while the
test, on the real clock, measures with ``time.monotonic`` how long a wait lasted.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
import redis
from celery import Celery

from runcell_celery import ConcurrencyTimeoutError, slot
from runcell_celery.celery import registry_for
from tests.conftest import wait_until
from tests.support.celery_app import REDIS_URL

SKEW_S = 120.0
BUDGET_MS = 3_000
MAX_WAIT_MS = 3_000
LIMITS = {
    "max_concurrent": 1,
    "lease_ttl_ms": 10_000,
    "workloads": {"background": {}, "interactive": {"max_wait_ms": MAX_WAIT_MS}},
    "default_workload": "background",
}
#: Far looser than the skew: a wait decided by a skewed clock is off by two minutes.
SLACK_S = 10.0


@pytest.fixture
def settings(celery_settings: dict[str, Any]) -> dict[str, Any]:
    return {
        **celery_settings,
        "runcell": {**celery_settings["runcell"], "LIMITERS": {"llm": LIMITS}},
    }


def _start(worker_processes, settings: dict[str, Any], app: Celery, skew_s: float) -> Any:
    """Start a worker whose clock is ``skew_s`` off; return once it runs tasks."""
    group = worker_processes(**{**settings, "clock_skew_s": skew_s})
    proc = group.start(concurrency=1)
    try:
        report = app.tasks["rc.pool_report"].delay().get(timeout=60)
    except Exception:
        print(group.logs())
        raise
    assert report["pid"] != proc.pid  # a prefork child of this worker answered
    return group, proc


def _timed_out_after(app: Celery, task: str, **options: Any) -> float:
    """Send ``task`` while the only slot is held here; return the seconds until it
    failed with ``ConcurrencyTimeoutError``."""
    with slot(registry_for(app).get("llm")):
        sent = time.monotonic()
        result = app.tasks[task].apply_async((5,), **options)
        with pytest.raises(ConcurrencyTimeoutError):
            result.get(timeout=BUDGET_MS / 1000 + SKEW_S / 2)
        return time.monotonic() - sent


@pytest.mark.parametrize("skew_s", [SKEW_S, -SKEW_S], ids=["ahead", "behind"])
def test_a_run_budget_runs_out_after_its_duration_on_a_worker_with_a_skewed_clock(
    make_app, worker_processes, settings, skew_s: float
) -> None:
    app = make_app(**settings)
    _start(worker_processes, settings, app, skew_s)
    waited = _timed_out_after(app, "rc.wait", concurrency={"timeout_ms": BUDGET_MS})
    assert BUDGET_MS / 1000 * 0.8 <= waited <= BUDGET_MS / 1000 + SLACK_S, waited


@pytest.mark.parametrize("skew_s", [SKEW_S, -SKEW_S], ids=["ahead", "behind"])
def test_a_slot_wait_lasts_its_full_max_wait_ms_on_a_worker_with_a_skewed_clock(
    make_app, worker_processes, settings, skew_s: float
) -> None:
    app = make_app(**settings)
    _start(worker_processes, settings, app, skew_s)
    waited = _timed_out_after(app, "rc.wait", concurrency={"workload": "interactive"})
    assert MAX_WAIT_MS / 1000 * 0.8 <= waited <= MAX_WAIT_MS / 1000 + SLACK_S, waited


#: "Honours a budget to within a second": neither ended early nor late by more.
PRECISE_S = 1.0


@pytest.fixture
def extra_queues() -> Iterator[list[str]]:
    """Queues a test adds beside its own (one per worker clock); emptied afterwards."""
    queues: list[str] = []
    yield queues
    client = redis.Redis.from_url(REDIS_URL)
    for queue in queues:
        client.delete(queue, f"{queue}-unacked", f"{queue}-unacked-index", f"{queue}-unacked-mutex")


def _watch_budgets(
    worker_events: Callable[[], list[dict[str, Any]]], sent: dict[str, float], timeout_s: float
) -> dict[str, tuple[float, float]]:
    """Watch the runs' events until each timed out.

    Returns per run ``(from_sent, from_waiting)``: the seconds, on this process's
    monotonic clock, from sending the task to its ``timed-out`` event, and from its
    ``wait-started`` event to it (each as first seen here). The run's budget starts
    after it was sent and before it waits, so a budget honoured to within a second
    has ``from_sent >= budget - 1`` (not ended early) and ``from_waiting <= budget + 1``
    (not ended late), whatever delays the broker and a loaded machine add outside it.
    """
    waiting: dict[str, float] = {}
    ended: dict[str, float] = {}
    give_up = time.monotonic() + timeout_s
    while len(ended) < len(sent):
        assert time.monotonic() < give_up, f"runs never timed out: {set(sent) - set(ended)}"
        now = time.monotonic()
        for event in worker_events():
            run_id = event.get("run_id")
            if run_id in sent and event["type"] == "wait-started":
                waiting.setdefault(run_id, now)
            elif run_id in sent and event["type"] == "timed-out":
                ended.setdefault(run_id, now)
        time.sleep(0.02)
    assert set(waiting) == set(sent), "a run timed out without waiting for the held slot"
    return {run: (ended[run] - sent[run], ended[run] - waiting[run]) for run in sent}


@pytest.mark.parametrize(
    "budget_ms",
    [pytest.param(5_000, id="5s"), pytest.param(60_000, id="60s", marks=pytest.mark.stress)],
)
def test_a_budget_is_honoured_to_within_a_second_by_workers_two_minutes_ahead_and_behind(
    make_app, worker_processes, worker_events, settings, extra_queues, budget_ms: int
) -> None:
    # One worker per clock, each on a queue of its own, both waiting at once.
    apps: dict[float, Celery] = {}
    for skew_s in (SKEW_S, -SKEW_S):
        queue = f"{settings['queue']}-{'ahead' if skew_s > 0 else 'behind'}"
        extra_queues.append(queue)
        on_queue = {**settings, "queue": queue}
        apps[skew_s] = make_app(**on_queue)
        _start(worker_processes, on_queue, apps[skew_s], skew_s)
    with slot(registry_for(apps[SKEW_S]).get("llm")):  # held longer than any budget
        results = {}
        sent = {}
        for skew_s, app in apps.items():
            result = app.tasks["rc.wait"].apply_async((5,), concurrency={"timeout_ms": budget_ms})
            results[skew_s], sent[result.id] = result, time.monotonic()
        timings = _watch_budgets(worker_events, sent, budget_ms / 1000 + 60)
    budget_s = budget_ms / 1000
    for skew_s, result in results.items():
        from_sent, from_waiting = timings[result.id]
        print(
            f"skew {skew_s:+.0f} s: timed out {from_sent:.3f} s after sending, "
            f"{from_waiting:.3f} s after waiting"
        )
        assert from_sent >= budget_s - PRECISE_S, (skew_s, from_sent)
        assert from_waiting <= budget_s + PRECISE_S, (skew_s, from_waiting)
        with pytest.raises(ConcurrencyTimeoutError):
            result.get(timeout=30)


def _parked_and_acked(dsn: str, queue: str) -> bool:
    """The run's row is parked and its message acked: the first worker is done with it."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT count(*) FROM runcell_queue WHERE parked").fetchone()
    unacked = redis.Redis.from_url(REDIS_URL).hlen(f"{queue}-unacked")
    return row is not None and row[0] == 1 and unacked == 0


@pytest.mark.parametrize(
    ("first_skew_s", "second_skew_s"),
    [(SKEW_S, -SKEW_S), (-SKEW_S, SKEW_S)],
    ids=["ahead-then-behind", "behind-then-ahead"],
)
def test_a_parked_run_keeps_its_budget_when_a_worker_with_another_clock_runs_it(
    make_app, worker_processes, pg_dsn, settings, first_skew_s, second_skew_s
) -> None:
    budget_ms = 60_000
    app = make_app(**settings)
    first, _ = _start(worker_processes, settings, app, first_skew_s)
    with slot(registry_for(app).get("llm")):
        sent = time.monotonic()
        result = app.tasks["rc.defer_budget"].apply_async(
            (5,), concurrency={"timeout_ms": budget_ms}
        )
        wait_until(
            lambda: _parked_and_acked(pg_dsn, settings["queue"]),
            "the run is parked and its message acked",
            60,
            interval=0.05,
        )
        # Only a worker whose clock is four minutes off the first's is left to run it.
        first.stop_all()
        _start(worker_processes, settings, app, second_skew_s)
        time.sleep(1.0)
    info = result.get(timeout=60)
    elapsed_ms = (time.monotonic() - sent) * 1000
    # Its budget counts from its first start, on the database's clock: spent by what
    # the test saw pass, give or take; never restarted, never moved by 240 s.
    assert budget_ms - elapsed_ms - SLACK_S * 1000 <= info["remaining_ms"], info
    assert info["remaining_ms"] <= budget_ms - 1_000, info
