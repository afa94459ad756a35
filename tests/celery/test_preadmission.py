"""Admission is decided before a deferrable task's body runs (issue 11).

A parked or duplicate delivery never starts its body; a granted one starts it holding
its first slot, which the body's first ``slot()`` adopts. Real ``celery worker``
subprocesses (prefork), Redis broker and results, PostgreSQL limiter, the fake
provider as the witness of the limit. App: :mod:`tests.celery.preadmission_app`.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from celery.result import AsyncResult

from runcell_celery.celery import registry_for
from runcell_celery.postgres import PostgresBackend
from runcell_celery.testing import FakeProvider
from tests.conftest import settled_counts, wait_until
from tests.support.celery_fixtures import WorkerScenario

from . import preadmission_app


class Scenario(WorkerScenario):
    """One test's app, worker processes (stopped by PID) and Redis records."""

    def __init__(self, pg_dsn: str, provider: FakeProvider, log_dir: Path) -> None:
        super().__init__("pre", pg_dsn, log_dir, preadmission_app)
        self.settings["limiter"] = f"pre-{self.tag}"
        self.settings["limits"] = {"max_concurrent": 1, "lease_ttl_ms": 5_000}
        self.settings["provider_url"] = provider.url
        self.dsn = pg_dsn

    def configure(self, **limits: Any) -> None:
        self.settings["limits"] = {**self.settings["limits"], **limits}

    @property
    def limiter(self) -> str:
        return str(self.settings["limiter"])

    def records(self, what: str) -> list[Any]:
        key = f"{self.settings['records_key']}:{what}"
        return [json.loads(raw) for raw in self.redis.lrange(key, 0, -1)]

    def open_gate(self, times: int = 1) -> None:
        self.redis.rpush(f"{self.settings['records_key']}:gate", *["go"] * times)

    def active(self) -> int:
        return registry_for(self.app).get(self.limiter).stats().active

    def counts(self, task_name: str) -> dict[str, int]:
        return self.admission_counts(task_name).get(self.limiter, {})

    def parked(self) -> int:
        with psycopg.connect(self.dsn) as conn:
            row = conn.execute(
                "SELECT count(*) FROM runcell_queue WHERE limiter = %s AND parked", [self.limiter]
            ).fetchone()
        return int(row[0]) if row else 0


@pytest.fixture
def scenario(pg_dsn: str, provider: FakeProvider, tmp_path: Path) -> Iterator[Scenario]:
    with Scenario(pg_dsn, provider, tmp_path) as made:
        yield made


def _deferred_batch(scenario: Scenario, tasks: int) -> tuple[list[str], list[dict[str, Any]]]:
    """Run ``tasks`` side-effect tasks on one slot and four processes (most park);
    return their ids and replies."""
    scenario.start_worker(concurrency=4)
    results = [scenario.app.tasks["pre.side_effect"].delay(150) for _ in range(tasks)]
    replies: list[dict[str, Any]] = scenario.replies(results)
    counts = settled_counts(
        lambda: scenario.counts("pre.side_effect"),
        lambda counts: counts.get("provider_attempts", 0) >= tasks,
        "the workers' counts are written",
    )
    assert counts["deferrals"] > 0, f"no task was deferred; the test proves nothing: {counts}"
    assert counts["deliveries"] == tasks + counts["deferrals"], counts
    assert counts["provider_attempts"] == tasks, counts
    assert counts["concurrency_failures"] == 0, counts
    assert scenario.parked() == 0
    return [result.id for result in results], replies


def test_work_before_the_first_slot_runs_once_per_task_even_when_it_was_deferred(
    scenario: Scenario,
) -> None:
    _deferred_batch(scenario, tasks=8)
    before = scenario.redis.get(f"{scenario.settings['records_key']}:before")
    assert before is not None
    assert int(before) == 8, f"the work before slot() ran {int(before)} times for 8 tasks"


def test_a_body_guarding_its_slot_with_try_finally_never_sees_a_deferral(
    scenario: Scenario,
) -> None:
    task_ids, replies = _deferred_batch(scenario, tasks=8)
    assert scenario.records("caught") == [], "a deferral passed through the task body"
    assert sorted(scenario.records("finally")) == sorted(task_ids)  # once per task
    assert [reply["retries"] for reply in replies] == [0] * 8


def test_the_adopted_slot_is_the_pre_admitted_lease_and_the_limit_holds(
    scenario: Scenario, provider: FakeProvider
) -> None:
    scenario.configure(max_concurrent=2)
    scenario.start_worker(concurrency=4)
    results = [scenario.app.tasks["pre.side_effect"].delay(100) for _ in range(12)]
    replies = scenario.replies(results)
    for reply in replies:
        assert reply["adopted"] == reply["pre_admitted"], reply
    tokens = [reply["adopted"][1] for reply in replies]
    assert len(set(tokens)) == 12, f"fencing tokens shared between runs: {tokens}"
    witness = provider.stats()
    assert witness.max_in_flight <= 2, f"the provider saw {witness.max_in_flight} in flight"
    assert witness.max_in_flight == 2, "the limit was never reached; the test proves nothing"
    assert witness.rejected_stale == 0
    assert witness.completed == 12
    acquired = [e for e in scenario.records("events") if e["type"] == "acquired"]
    assert sorted(e["lease_id"] for e in acquired) == sorted(r["adopted"][0] for r in replies)
    assert scenario.active() == 0


def test_a_body_that_never_calls_slot_holds_its_slot_until_it_ends(scenario: Scenario) -> None:
    scenario.start_worker(concurrency=2)
    first = scenario.app.tasks["pre.no_slot"].delay()
    wait_until(lambda: scenario.records("started"), "the first body started", 60, interval=0.05)
    assert scenario.active() == 1  # pre-admitted: the body's work occupies the slot
    second = scenario.app.tasks["pre.no_slot"].delay()
    wait_until(lambda: scenario.parked() == 1, "the second task parks", 60, interval=0.05)
    assert len(scenario.records("started")) == 1, "a body ran without a slot"

    scenario.open_gate(times=2)
    assert scenario.replies([first, second]) == ["done", "done"]
    assert scenario.active() == 0
    assert len(scenario.records("started")) == 2
    events = scenario.records("events")
    assert [e for e in events if e["type"] in ("acquired", "released")] == [], (
        "a slot no provider request used was reported as one"
    )


@pytest.mark.parametrize("how", ["force-released", "paused past its ttl"])
def test_a_pre_admitted_lease_lost_before_the_first_slot_fails_it_without_running_its_block(
    scenario: Scenario, pg_dsn: str, how: str
) -> None:
    ttl_s = 1.5
    scenario.configure(lease_ttl_ms=int(ttl_s * 1000))
    scenario.start_worker(concurrency=1)
    result = scenario.app.tasks["pre.gated_slot"].delay()
    wait_until(lambda: scenario.records("pre_admitted"), "the body started", 60, interval=0.05)
    (started,) = scenario.records("pre_admitted")
    if how == "force-released":
        backend = PostgresBackend(database=pg_dsn)
        try:
            assert [r.lease_id for r in backend.force_release([started["lease_id"]])] == [
                started["lease_id"]
            ]
        finally:
            backend.close()
        # Past a whole TTL the keeper has tried to renew it (every third of the TTL),
        # and a lease not renewed is lost anyway.
        time.sleep(ttl_s + 0.5)
    else:
        os.kill(started["pid"], signal.SIGSTOP)
        try:
            time.sleep(ttl_s + 0.5)
        finally:
            os.kill(started["pid"], signal.SIGCONT)
    scenario.open_gate()

    with pytest.raises(Exception) as caught:  # noqa: PT011 - the type is rebuilt by Celery
        result.get(timeout=60, propagate=True)
    assert type(caught.value).__name__ == "ConcurrencyLeaseLostError", repr(caught.value)
    assert AsyncResult(result.id, app=scenario.app).state == "FAILURE"
    assert scenario.records("guarded") == [], "the guarded block ran on a lost lease"
    lost = [e for e in scenario.records("events") if e["type"] == "lease-lost"]
    assert [e["lease_id"] for e in lost] == [started["lease_id"]]
    assert scenario.active() == 0
