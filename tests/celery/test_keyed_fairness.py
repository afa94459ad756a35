"""Keyed limits on a prefork worker: with deferral every tenant is served; in ``wait``
mode one busy tenant's blocked tasks take the worker's processes, and the worker warns
of it when it starts (issue 21).

A provider limit of 3 over all tenants (its line served by tenant in turn), 1 per
tenant, a ``-c 4`` worker. The busy
tenant sends eight tasks, then two other tenants one each. The witness is the order in
which tasks got their slots (:mod:`tests.celery.tenants_app`), not a wall clock: with
``"defer"`` the busy tenant's extra tasks are parked and free their processes, so the
other tenants' tasks get slots beside its first one; with ``"wait"`` they sit in the
broker behind the busy tenant's blocked tasks and start only after several of them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.celery_fixtures import WorkerScenario

from . import tenants_app

BUSY, OTHERS = "acme", ("globex", "initech")
BUSY_TASKS = 8
CONCURRENCY = 4
#: Long enough for the busy tenant's other tasks to park while its first holds its slot.
LATENCY_MS = 800


class Scenario(WorkerScenario):
    def __init__(self, pg_dsn: str, log_dir: Path) -> None:
        super().__init__("tenants", pg_dsn, log_dir, tenants_app)
        self.settings.update(
            provider=f"provider-{self.tag}", tenant=f"tenant-{self.tag}", limit=3, per_tenant=1
        )

    def starts(self) -> list[str]:
        raw = self.redis.lrange(f"{self.settings['records_key']}:starts", 0, -1)
        return [item.decode() for item in raw]


@pytest.fixture
def scenario(pg_dsn: str, tmp_path: Path) -> Iterator[Scenario]:
    with Scenario(pg_dsn, tmp_path) as made:
        yield made


def _run(scenario: Scenario, task_name: str) -> list[str]:
    scenario.start_worker(concurrency=CONCURRENCY)
    task = scenario.app.tasks[task_name]
    sent = [task.delay(BUSY, LATENCY_MS) for _ in range(BUSY_TASKS)]
    sent += [task.delay(tenant, LATENCY_MS) for tenant in OTHERS]
    replies = scenario.replies(sent)
    assert replies == [BUSY] * BUSY_TASKS + list(OTHERS)
    starts = scenario.starts()
    assert sorted(starts) == sorted(replies), starts
    return starts


def _first_place(starts: list[str], tenant: str) -> int:
    return starts.index(tenant) + 1


def _second_place(starts: list[str], tenant: str) -> int:
    return starts.index(tenant, starts.index(tenant) + 1) + 1


@pytest.mark.stress  # a whole-system run of many seconds; CI runs the stress suite too
def test_with_deferral_other_tenants_get_slots_beside_the_busy_tenants_first_task(
    scenario: Scenario,
) -> None:
    starts = _run(scenario, "tenants.defer")
    second = _second_place(starts, BUSY)
    for tenant in OTHERS:
        # Beside the busy tenant's first task: the provider's three slots, one per tenant.
        assert _first_place(starts, tenant) < second, starts
    logs = scenario.logs()
    assert "'tenants.defer'" not in logs, logs  # a deferring task is not warned of


@pytest.mark.stress  # a whole-system run of many seconds; CI runs the stress suite too
def test_in_wait_mode_the_busy_tenant_takes_the_processes_and_the_worker_warns(
    scenario: Scenario,
) -> None:
    starts = _run(scenario, "tenants.wait")
    # The busy tenant's blocked tasks held the processes: its second task went first.
    second = _second_place(starts, BUSY)
    assert min(_first_place(starts, tenant) for tenant in OTHERS) > second, starts
    logs = scenario.logs()
    tenant = scenario.settings["tenant"]
    warning = (
        f"task 'tenants.wait' waits for a slot of the keyed limiter {tenant!r} "
        '("admission": "wait") with 1 slot per key, on a worker running 4 tasks at once'
    )
    assert logs.count(warning) == 1, logs
    assert 'Declare "admission": "defer"' in logs
