"""A task over two PostgreSQL limiters and a key, run by a real prefork worker:
``concurrency={"limiter": [<provider>, <tenant>], "key": "{tenant_id}"}`` with the
provider limited to 3 and each tenant (a keyed limiter) to 1.

The witness is Redis, not the limiter: each task counts itself in flight per tenant and
in total inside its slot (:mod:`tests.celery.several_app`). Both limits hold and both
are reached: the tenants together fill the provider's 3 but never 2 of one tenant, and
one tenant alone runs one at a time though the provider has room. Every slot is one
request over both limiters (its events name both, the key's limiter as
``tenant:<key>``), counted under the names joined. With ``admission: "defer"`` a run
that finds no room parks as one request over both limiters, and both limits still hold
when the parked runs are re-published and claim their slots together.

A tenant's second task waiting while its first runs must not hold up another tenant's
task that has room (as ``allocate_members`` and the in-memory limiter decide).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from celery.result import AsyncResult

from tests.celery import several_app
from tests.celery.several_app import DEFERRED_TASK, TASK
from tests.conftest import settled_counts, wait_until
from tests.support.celery_fixtures import WorkerScenario

TENANTS = ("acme", "globex", "initech", "umbrella", "hooli")
PROVIDER_LIMIT = 3
TENANT_LIMIT = 1
HOLD_MS = 50

#: A task sent for a tenant, and its result.
Sent = tuple[str, AsyncResult[Any]]


class Scenario(WorkerScenario):
    """One test's app, worker processes (stopped by PID) and Redis records."""

    def __init__(self, pg_dsn: str, log_dir: Path) -> None:
        super().__init__("several", pg_dsn, log_dir, several_app)
        self.settings.update(
            provider=f"provider-{self.tag}",
            tenant=f"tenant-{self.tag}",
            provider_limits={"max_concurrent": PROVIDER_LIMIT, "lease_ttl_ms": 5_000},
            tenant_limits={"max_concurrent": TENANT_LIMIT, "keyed": True, "lease_ttl_ms": 5_000},
        )

    @property
    def provider(self) -> str:
        return str(self.settings["provider"])

    @property
    def tenant(self) -> str:
        return str(self.settings["tenant"])

    def send(self, tenants: list[str], hold_ms: float = HOLD_MS) -> list[Sent]:
        task = self.app.tasks[TASK]
        return [(tenant, task.delay(tenant, hold_ms)) for tenant in tenants]

    def in_flight(self, tenant: str) -> int:
        raw = self.redis.get(f"{self.settings['records_key']}:in:{tenant}")
        return int(raw) if raw is not None else 0

    def results(self, sent: list[Sent], timeout: float = 120) -> list[Any]:
        replies = self.replies([result for _, result in sent], timeout)
        assert [result.state for _, result in sent] == ["SUCCESS"] * len(sent)
        return replies

    def events(self, kind: str) -> list[dict[str, Any]]:
        raw = self.redis.lrange(f"{self.settings['records_key']}:events", 0, -1)
        return [event for event in map(json.loads, raw) if event["type"] == kind]

    def counts(self) -> dict[str, dict[str, int]]:
        """This test's admission counts by limiter label (the task's name is shared)."""
        counts = self.admission_counts(TASK)
        return {label: counted for label, counted in counts.items() if self.provider in label}


@pytest.fixture
def scenario(pg_dsn: str, tmp_path: Path) -> Iterator[Scenario]:
    with Scenario(pg_dsn, tmp_path) as made:
        yield made


def test_tenants_fill_the_providers_limit_but_never_run_two_of_one_tenant_at_once(
    scenario: Scenario,
) -> None:
    scenario.start_worker(concurrency=4)
    # Tenants in turn: a tenant's tasks are five apart, so four processes rarely ask for
    # one tenant twice at once (one tenant alone shows its limit binding, below).
    sent = scenario.send([tenant for _ in range(6) for tenant in TENANTS])
    replies = scenario.results(sent)

    for (tenant, _), reply in zip(sent, replies, strict=True):
        both = [scenario.provider, f"{scenario.tenant}:{tenant}"]
        assert _shown(reply) == {"limiters": both, "leases": both, "key": tenant}
    for tenant in TENANTS:
        assert scenario.highest(tenant) <= TENANT_LIMIT, (
            f"{scenario.highest(tenant)} tasks of {tenant} ran at once over its limit"
        )
    assert scenario.highest() <= PROVIDER_LIMIT, (
        f"{scenario.highest()} tasks ran at once over the provider's limit {PROVIDER_LIMIT}"
    )
    assert scenario.highest() == PROVIDER_LIMIT, "the provider's limit was never reached"
    assert {scenario.highest(tenant) for tenant in TENANTS} == {TENANT_LIMIT}

    # One request over both limiters per slot: its events name both, and its key.
    acquired = scenario.events("acquired")
    assert len(acquired) == len(sent), scenario.logs()
    for event in acquired:
        assert event["holder_name"] == TASK
        assert event["limiter"] == scenario.provider
        assert event["limiters"] == [scenario.provider, f"{scenario.tenant}:{event['key']}"]
    assert sorted(event["key"] for event in acquired) == sorted(tenant for tenant, _ in sent)
    released = scenario.events("released")
    assert [event["outcome"] for event in released] == ["success"] * len(sent)

    # Counted under the limiters' names joined, one row for every tenant.
    label = f"{scenario.provider}+{scenario.tenant}"
    wait_until(
        lambda: scenario.counts().get(label, {}).get("provider_attempts", 0) >= len(sent),
        "the worker's counts are written under the limiters' names joined",
        30,
        interval=0.1,
    )
    assert scenario.counts() == {
        label: {
            "deliveries": len(sent),
            "deferrals": 0,
            "provider_attempts": len(sent),
            "provider_failures": 0,
            "concurrency_failures": 0,
        }
    }


def test_one_tenant_alone_runs_one_at_a_time_though_the_provider_has_room(
    scenario: Scenario,
) -> None:
    scenario.start_worker(concurrency=4)
    sent = scenario.send(["acme"] * 8)
    replies = scenario.results(sent)
    both = [scenario.provider, f"{scenario.tenant}:acme"]
    shown = {"limiters": both, "leases": both, "key": "acme"}
    assert [_shown(r) for r in replies] == [shown] * len(sent)
    assert scenario.highest("acme") == TENANT_LIMIT
    assert scenario.highest() == TENANT_LIMIT, "the tenant's limit did not bind"
    # Four processes asked at once: some waited for the tenant's slot.
    waited = [event for event in scenario.events("acquired") if event["wait_ms"] >= HOLD_MS / 2]
    assert waited, "no task waited for the tenant: the test proves nothing"


def test_a_tenant_with_room_is_not_held_up_by_another_tenants_waiting_task(
    scenario: Scenario,
) -> None:
    scenario.start_worker(concurrency=3)
    ((_, long),) = scenario.send(["acme"], hold_ms=1_500)
    wait_until(lambda: scenario.in_flight("acme") == 1, "acme's first task runs", 30)
    ((_, behind),) = scenario.send(["acme"])
    wait_until(
        lambda: any(e["run_id"] == behind.id for e in scenario.events("wait-started")),
        "acme's second task waits for its tenant",
        30,
    )
    # The provider holds 1 of 3 (one more set aside for acme's waiting task); globex has
    # no task at all: its task has room in both of its limiters.
    ((_, other),) = scenario.send(["globex"])
    scenario.results([("globex", other), ("acme", long), ("acme", behind)])
    released = {e["request_id"]: e for e in scenario.events("released")}
    acquired = {e["key"]: e for e in scenario.events("acquired") if e["key"] == "globex"}
    globex_done = released[acquired["globex"]["request_id"]]["timestamp"]
    acme_first = min(e["timestamp"] for e in released.values() if e["key"] == "acme")
    assert globex_done < acme_first, (
        f"globex's task waited {acquired['globex']['wait_ms']:.0f} ms, until acme's first "
        "task released its slots, though the provider and globex had room"
    )


def _shown(reply: dict[str, Any]) -> dict[str, Any]:
    return {name: reply[name] for name in ("limiters", "leases", "key")}


def test_deferred_tasks_over_both_limiters_park_as_one_and_keep_both_limits(
    scenario: Scenario,
) -> None:
    scenario.start_worker(concurrency=4)
    task = scenario.app.tasks[DEFERRED_TASK]
    tenants = [tenant for _ in range(6) for tenant in TENANTS[:3]] + ["acme"] * 6
    sent = [(tenant, task.delay(tenant, 100)) for tenant in tenants]
    replies = scenario.results(sent)

    for (tenant, _), reply in zip(sent, replies, strict=True):
        both = [scenario.provider, f"{scenario.tenant}:{tenant}"]
        assert _shown(reply) == {"limiters": both, "leases": both, "key": tenant}
    for tenant in TENANTS[:3]:
        assert scenario.highest(tenant) <= TENANT_LIMIT, (
            f"{scenario.highest(tenant)} tasks of {tenant} ran at once over its limit"
        )
    assert scenario.highest() <= PROVIDER_LIMIT, (
        f"{scenario.highest()} tasks ran at once over the provider's limit {PROVIDER_LIMIT}"
    )
    # Fencing tokens are never handed out twice in one limiter: each run held its own.
    provider_tokens = [reply["tokens"][scenario.provider] for reply in replies]
    assert len(set(provider_tokens)) == len(sent)

    label = f"{scenario.provider}+{scenario.tenant}"

    def counted() -> dict[str, int]:
        return scenario.admission_counts(DEFERRED_TASK).get(label, {})

    counts = settled_counts(
        counted,
        lambda counts: counts.get("provider_attempts", 0) >= len(sent),
        "the worker's counts are written",
    )
    assert counts["deferrals"] > 0, "no run parked: the test proves nothing"
    # Each deferral adds one delivery (the re-published message), never a failure.
    assert counts["deliveries"] == len(sent) + counts["deferrals"]
    assert counts["provider_attempts"] == len(sent)
    assert counts["concurrency_failures"] == 0
    # Nothing is left behind in either limiter once every run finished.
    wait_until(lambda: _rows_left(scenario) == (0, 0), "no lease or queue row is left", 15)


def _rows_left(scenario: Scenario) -> tuple[int, int]:
    """Leases and queue rows of the test's limiters (the provider and tenant keys)."""
    names = [scenario.provider, f"{scenario.tenant}:%"]
    with psycopg.connect(str(scenario.settings["database"]), autocommit=True) as conn:
        leases, queued = conn.execute(
            "SELECT (SELECT count(*) FROM runcell_lease WHERE limiter LIKE ANY(%(n)s)),"
            " (SELECT count(*) FROM runcell_queue WHERE limiter LIKE ANY(%(n)s))",
            {"n": names},
        ).fetchone() or (0, 0)
    return int(leases), int(queued)
