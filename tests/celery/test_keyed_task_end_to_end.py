"""A task limited per tenant: ``concurrency={"limiter": "tenant", "key": "{tenant_id}"}``
on a keyed PostgreSQL limiter, run by a real prefork worker (issue 12).

The witness is Redis, not the limiter: each task counts itself in flight per tenant and
in total inside its slot (:mod:`tests.celery.keyed_app`). Every tenant stays within its
limit of 2 while the tenants together go above it (each key is a limit of its own), for
tasks that wait and for tasks that park; a message sent by name without the
``runcell_key`` header has its key formed from its arguments on the worker; a malformed
header fails the task naming the header, and its body does not run.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from celery.result import AsyncResult

from tests.conftest import settled_counts
from tests.support.celery_fixtures import WorkerScenario

from . import keyed_app

TENANTS = ("acme", "globex", "initech")
LIMIT = 2


class Scenario(WorkerScenario):
    """One test's app, worker processes (stopped by PID) and Redis records."""

    def __init__(self, pg_dsn: str, log_dir: Path) -> None:
        super().__init__("keyed", pg_dsn, log_dir, keyed_app)
        self.settings["limiter"] = f"tenant-{self.tag}"
        self.settings["limits"] = {"max_concurrent": LIMIT, "keyed": True, "lease_ttl_ms": 5_000}

    @property
    def limiter(self) -> str:
        return str(self.settings["limiter"])

    def counts(self, task_name: str) -> dict[str, int]:
        return self.admission_counts(task_name).get(self.limiter, {})


@pytest.fixture
def scenario(pg_dsn: str, tmp_path: Path) -> Iterator[Scenario]:
    with Scenario(pg_dsn, tmp_path) as made:
        yield made


@pytest.mark.parametrize("task_name", ["keyed.call", "keyed.defer"])
def test_each_tenant_stays_within_its_own_limit_while_tenants_run_side_by_side(
    scenario: Scenario, task_name: str
) -> None:
    scenario.start_worker(concurrency=8)
    task = scenario.app.tasks[task_name]
    sent = [(tenant, task.delay(tenant, 150)) for _ in range(5) for tenant in TENANTS]
    replies = scenario.replies([result for _, result in sent])
    for (tenant, _), reply in zip(sent, replies, strict=True):
        assert reply["limiter"] == f"{scenario.limiter}:{tenant}"
        assert reply["lease_limiter"] == f"{scenario.limiter}:{tenant}"
    for tenant in TENANTS:
        assert scenario.highest(tenant) <= LIMIT, (
            f"{scenario.highest(tenant)} tasks of {tenant} ran at once over its limit {LIMIT}"
        )
        assert scenario.highest(tenant) == LIMIT, f"{tenant} never used its limit: no proof"
    assert scenario.highest() > LIMIT, "the tenants never ran side by side: one limit for all?"
    # Counted under the keyed limiter's name, one row for every tenant.
    counts = settled_counts(
        lambda: scenario.counts(task_name),
        lambda counts: counts.get("provider_attempts", 0) >= len(sent),
        "the worker's counts are written under the keyed limiter's name",
    )
    assert counts["provider_attempts"] == len(sent), counts
    assert counts["deliveries"] == len(sent) + counts["deferrals"], counts
    assert counts["concurrency_failures"] == 0, counts
    if task_name == "keyed.defer":
        assert counts["deferrals"] > 0, f"no task parked; the test proves nothing: {counts}"


def test_a_message_sent_by_name_without_the_key_header_gets_its_key_from_its_arguments(
    scenario: Scenario,
) -> None:
    scenario.start_worker(concurrency=2)
    by_name = scenario.app.send_task("keyed.call", args=("umbrella", 10))
    by_keyword = scenario.app.send_task("keyed.call", kwargs={"tenant_id": "hooli"})
    first, second = scenario.replies([by_name, by_keyword])
    assert first["limiter"] == f"{scenario.limiter}:umbrella"
    assert second["limiter"] == f"{scenario.limiter}:hooli"


def test_a_malformed_key_header_fails_the_task_naming_the_header_and_the_body_never_runs(
    scenario: Scenario,
) -> None:
    scenario.start_worker(concurrency=2)
    bad = scenario.app.send_task("keyed.call", args=("acme", 10), headers={"runcell_key": "a\nb"})
    with pytest.raises(Exception, match=r"message header 'runcell_key'.*control characters"):
        bad.get(timeout=60)
    assert scenario.highest("acme") == 0, "the body ran"


def test_a_child_sent_from_a_keyed_run_inherits_its_tenants_limiter(scenario: Scenario) -> None:
    scenario.start_worker(concurrency=2)
    (child_id,) = scenario.replies([scenario.app.tasks["keyed.parent"].delay("acme")])
    (reply,) = scenario.replies([AsyncResult(child_id, app=scenario.app)])
    assert reply["limiter"] == f"{scenario.limiter}:acme"
