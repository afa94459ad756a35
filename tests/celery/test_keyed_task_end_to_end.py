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

import contextlib
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.result import AsyncResult

from runcell_celery.celery import admission_counts
from tests.conftest import wait_until

from .keyed_app import ENV, REDIS_URL, create_app

ROOT = Path(__file__).resolve().parents[2]
TENANTS = ("acme", "globex", "initech")
LIMIT = 2


class Scenario:
    """One test's app, worker processes (stopped by PID) and Redis records."""

    def __init__(self, pg_dsn: str, log_dir: Path) -> None:
        tag = uuid.uuid4().hex[:10]
        self.settings: dict[str, Any] = {
            "queue": f"runcell-keyed-{tag}",
            "database": pg_dsn,
            "limiter": f"tenant-{tag}",
            "limits": {"max_concurrent": LIMIT, "keyed": True, "lease_ttl_ms": 5_000},
            "records_key": f"runcell-keyed-records-{tag}",
        }
        self.log_dir = log_dir
        self.redis = redis.Redis.from_url(REDIS_URL)
        self.procs: list[subprocess.Popen[bytes]] = []
        self._app: Celery | None = None

    @property
    def app(self) -> Celery:
        if self._app is None:
            self._app = create_app(self.settings)
        return self._app

    @property
    def limiter(self) -> str:
        return str(self.settings["limiter"])

    def start_worker(self, concurrency: int) -> None:
        hostname = f"keyed-{uuid.uuid4().hex[:6]}@test"
        env = {**os.environ, ENV: json.dumps(self.settings), "PYTHONPATH": str(ROOT)}
        log = open(self.log_dir / f"{hostname}.log", "wb")  # noqa: SIM115 - closed in stop()
        command = [
            sys.executable, "-m", "celery", "-A", "tests.celery.keyed_app:app",
            "worker", "--pool=prefork", f"--concurrency={concurrency}",
            "-Q", self.settings["queue"], f"--hostname={hostname}", "--loglevel=WARNING",
            "--without-gossip", "--without-mingle", "--without-heartbeat",
        ]  # fmt: skip
        proc = subprocess.Popen(
            command,
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        proc.log = log  # type: ignore[attr-defined]
        self.procs.append(proc)
        wait_until(
            lambda: self.app.control.ping(destination=[hostname], timeout=0.5),
            "the worker answers",
            60,
            interval=0.1,
        )

    def highest(self, tenant: str | None = None) -> int:
        """The most tasks seen in flight at once (for ``tenant``, or in total)."""
        suffix = f":{tenant}" if tenant is not None else ""
        raw = self.redis.get(f"{self.settings['records_key']}:max{suffix}")
        return int(raw) if raw is not None else 0

    def results(self, results: list[AsyncResult], timeout: float = 120) -> list[Any]:
        try:
            return [result.get(timeout=timeout) for result in results]
        except Exception:
            print(self.logs())
            raise

    def counts(self, task_name: str) -> dict[str, int]:
        for count in admission_counts(self.app):
            if count.task_name == task_name and count.limiter == self.limiter:
                return {
                    "deliveries": count.deliveries,
                    "deferrals": count.deferrals,
                    "provider_attempts": count.provider_attempts,
                    "concurrency_failures": count.concurrency_failures,
                }
        return {}

    def logs(self) -> str:
        return "\n".join(
            f"--- {path.name}\n{path.read_text(errors='replace')[-4000:]}"
            for path in sorted(self.log_dir.glob("*.log"))
        )

    def stop(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # stray pool children, if any
            proc.log.close()  # type: ignore[attr-defined]
        keys = list(self.redis.scan_iter(f"{self.settings['records_key']}:*"))
        queue = self.settings["queue"]
        self.redis.delete(queue, f"{queue}.runcell", *keys)


@pytest.fixture
def scenario(pg_dsn: str, tmp_path: Path) -> Iterator[Scenario]:
    made = Scenario(pg_dsn, tmp_path)
    try:
        yield made
    finally:
        made.stop()


@pytest.mark.parametrize("task_name", ["keyed.call", "keyed.defer"])
def test_each_tenant_stays_within_its_own_limit_while_tenants_run_side_by_side(
    scenario: Scenario, task_name: str
) -> None:
    scenario.start_worker(concurrency=8)
    task = scenario.app.tasks[task_name]
    sent = [(tenant, task.delay(tenant, 150)) for _ in range(5) for tenant in TENANTS]
    replies = scenario.results([result for _, result in sent])
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
    wait_until(
        lambda: scenario.counts(task_name).get("provider_attempts", 0) >= len(sent),
        "the worker's counts are written under the keyed limiter's name",
        30,
        interval=0.1,
    )
    counts = scenario.counts(task_name)
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
    first, second = scenario.results([by_name, by_keyword])
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
    (child_id,) = scenario.results([scenario.app.tasks["keyed.parent"].delay("acme")])
    (reply,) = scenario.results([AsyncResult(child_id, app=scenario.app)])
    assert reply["limiter"] == f"{scenario.limiter}:acme"
