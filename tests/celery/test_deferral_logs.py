"""What an operator reads in a worker's log about deferrals: one line per parking.

A parked task is acked through Celery's ``Ignore``, which Celery logs as "Task ...
ignored" — read as work thrown away. The worker here logs ``runcell_celery`` and
Celery's task tracer (``celery.app.trace``) at INFO, so Celery's own lines would show:
each parking must give exactly one ``deferred: parked at place N of limiter 'llm'``
line and no "ignored" line.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis
from celery import Celery

from runcell_celery import create_concurrency_limiter, slot
from runcell_celery.admission import Admission
from runcell_celery.celery import AdmissionCount, admission_counts, registry_for
from runcell_celery.celery.task import _log_deferral
from runcell_celery.ports import Parked, WaitEstimate
from tests.conftest import wait_until
from tests.support.celery_app import REDIS_URL

LIMITS = {
    "max_concurrent": 1,
    "lease_ttl_ms": 10_000,
    "workloads": {"interactive": {}, "background": {}},
    "default_workload": "background",
}
TASKS = 4
DEFERRED = re.compile(
    r"Task rc\.defer\[(?P<id>[0-9a-f-]+)\] deferred: parked at place (?P<place>\d+) "
    r"of limiter 'llm' \(workload 'background'\)"
)


def _parked_and_acked(dsn: str, queue: str, count: int) -> bool:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT count(*) FROM runcell_queue WHERE parked").fetchone()
    unacked = redis.Redis.from_url(REDIS_URL).hlen(f"{queue}-unacked")
    return row is not None and row[0] == count and unacked == 0


def _counts(app: Celery) -> AdmissionCount:
    rows = [c for c in admission_counts(app) if (c.task_name, c.limiter) == ("rc.defer", "llm")]
    return rows[0] if rows else AdmissionCount("rc.defer", "llm")


@pytest.fixture
def settings(celery_settings: dict[str, Any]) -> dict[str, Any]:
    return {
        **celery_settings,
        "runcell": {**celery_settings["runcell"], "LIMITERS": {"llm": LIMITS}},
        "log_levels": {"runcell_celery": "INFO", "celery.app.trace": "INFO"},
    }


def test_each_parking_logs_one_deferral_line_and_celery_logs_no_ignored_line(
    make_app, worker_processes, pg_dsn, settings
) -> None:
    app = make_app(**settings)
    group = worker_processes(**settings)
    # One pool process: the tasks park one after another, so their places are known.
    group.start(concurrency=1, name="deferrals")
    log = Path(group.log_dir) / "deferrals.log"
    app.tasks["rc.pool_report"].delay().get(timeout=60)
    before = _counts(app)
    with slot(registry_for(app).get("llm")):
        results = [app.tasks["rc.defer"].delay(5) for _ in range(TASKS)]
        wait_until(
            lambda: _parked_and_acked(pg_dsn, settings["queue"], TASKS),
            "every task is parked and its message acked",
            60,
            interval=0.05,
        )
        parked = [m.groupdict() for m in DEFERRED.finditer(log.read_text(errors="replace"))]
        assert [p["id"] for p in parked] == [r.id for r in results], log.read_text()
        assert [int(p["place"]) for p in parked] == list(range(1, TASKS + 1))
    for result in results:
        assert result.get(timeout=60)["retries"] == 0

    # Celery's tracer logs at INFO here: its success lines show, so would "ignored".
    # It logs a success after storing the result, so the last line may follow get().
    succeeded = re.compile(r"Task rc\.defer\[[0-9a-f-]+\] succeeded")
    wait_until(
        lambda: len(succeeded.findall(log.read_text(errors="replace"))) >= TASKS,
        "every success is logged",
        30,
        interval=0.1,
    )
    text = log.read_text(errors="replace")
    assert len(re.findall(r"Task rc\.defer\[[0-9a-f-]+\] succeeded", text)) == TASKS, text
    assert not re.search(r"Task rc\.defer\[[0-9a-f-]+\] ignored", text), text
    wait_until(
        lambda: _counts(app).deliveries - before.deliveries >= 2 * TASKS,
        "the worker wrote its counts",
        30,
        interval=0.2,
    )
    deferrals = _counts(app).deferrals - before.deferrals
    assert deferrals >= TASKS
    assert len(DEFERRED.findall(text)) == deferrals, text


# -- the line of a run over several limiters (no worker: the line itself) -------------


def _several_admission() -> Admission:
    openai = create_concurrency_limiter(
        1,
        name="openai",
        workloads={"interactive": {}, "background": {}},
        default_workload="background",
    )
    tenant = create_concurrency_limiter(1, name="tenant", keyed=True).key("acme")

    def never(*_: object) -> tuple[()]:
        raise AssertionError("not asked")

    return Admission(never, limiters=[openai, tenant], request_id="r1")


@pytest.mark.parametrize(
    ("workload", "expected"),
    [
        (None, "'openai' (workload 'background') + 'tenant:acme' (workload 'default')"),
        ("interactive", "'openai' (workload 'interactive') + 'tenant:acme' (workload 'default')"),
    ],
)
def test_the_deferral_line_of_a_run_over_several_limiters_names_each_with_its_workload(
    caplog: pytest.LogCaptureFixture, workload: str | None, expected: str
) -> None:
    parked = Parked(limiter="openai + tenant:acme", workload=workload or "background")
    with caplog.at_level(logging.INFO, logger="runcell_celery.celery"):
        _log_deferral("rc.several", "t-1", _several_admission(), workload, parked)
    (line,) = [r.getMessage() for r in caplog.records if "deferred" in r.getMessage()]
    assert f"Task rc.several[t-1] deferred: parked at place 0 of limiters {expected};" in line
    assert "None" not in line


def test_the_deferral_line_with_a_place_names_every_limiter_too(
    caplog: pytest.LogCaptureFixture,
) -> None:
    parked = Parked(
        limiter="openai + tenant:acme",
        workload="background",
        estimate=WaitEstimate(ahead=2, hold_ms=1000.0, slots=1),
    )
    with caplog.at_level(logging.INFO, logger="runcell_celery.celery"):
        _log_deferral("rc.several", "t-1", _several_admission(), None, parked)
    (line,) = [r.getMessage() for r in caplog.records if "deferred" in r.getMessage()]
    assert line.startswith(
        "Task rc.several[t-1] deferred: parked at place 3 of limiters 'openai' (workload "
        "'background') + 'tenant:acme' (workload 'default'), expected wait 3.0 s"
    )


def test_the_deferral_line_of_one_limiter_names_its_default_workload_not_none(
    caplog: pytest.LogCaptureFixture,
) -> None:
    llm = create_concurrency_limiter(1, name="llm", workloads={"batch": {}})
    admission = Admission(lambda *_: None, limiters=(llm,), request_id="r1")  # type: ignore[arg-type,return-value]
    parked = Parked(limiter="llm", workload="batch")
    with caplog.at_level(logging.INFO, logger="runcell_celery.celery"):
        _log_deferral("rc.one", "t-1", admission, None, parked)
    (line,) = [r.getMessage() for r in caplog.records if "deferred" in r.getMessage()]
    assert "of limiter 'llm' (workload 'batch');" in line
