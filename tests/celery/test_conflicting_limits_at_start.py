"""A limit changed in the settings of one of two workers, which is then restarted
(docs/postgres.md, "Changing limits on a running fleet"): under the default
``on_conflict="error"`` the restarted worker refuses to start, before it takes any
task, with one clear message and a non-zero exit status; the other worker serves
every task, so none fails.

Two real prefork ``celery worker`` subprocesses, each in its own session, stopped by
PID; results in Redis, the in-flight witness in Redis too.
"""

from __future__ import annotations

import copy
import logging
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery.result import AsyncResult

from runcell_celery.celery import registry_for
from runcell_celery.celery.conflicts import EX_CONFIG, WorkerRefused, refuse_conflicting_limits
from tests.support.celery_fixtures import LIMITS, WorkerScenario

from . import rolling_app

LIMIT = 2
CHANGED = 3
#: A port nothing listens on (privileged, never a test service's).
UNREACHABLE_DSN = "postgresql://postgres@127.0.0.1:1/test"


class Scenario(WorkerScenario):
    def __init__(self, pg_dsn: str, log_dir: Path) -> None:
        super().__init__("conflict", pg_dsn, log_dir, rolling_app)
        self.settings["limiter"] = f"provider-{self.tag}"
        self.settings["limits"] = {"max_concurrent": LIMIT}
        self.settings["on_conflict"] = "error"  # the default, said out loud


@pytest.fixture
def scenario(pg_dsn: str, tmp_path: Path) -> Iterator[Scenario]:
    with Scenario(pg_dsn, tmp_path) as made:
        yield made


def _send(scenario: Scenario, n: int) -> list[AsyncResult[Any]]:
    call = scenario.app.tasks["rolling.call"]
    return [call.delay(100) for _ in range(n)]


def test_a_worker_restarted_with_a_changed_limit_refuses_to_start_and_no_task_fails(
    scenario: Scenario,
) -> None:
    workers = scenario.workers
    steady = workers.start(concurrency=2, answering=scenario.app)
    restarted = workers.start(concurrency=2, answering=scenario.app)
    before = _send(scenario, 12)
    time.sleep(0.5)  # both workers are busy with them

    # One worker is restarted with a changed limit: a warm stop of its main process (its
    # running tasks end, those it reserved go back to the queue), then a start with
    # the new settings.
    os.kill(restarted.pid, signal.SIGTERM)
    assert restarted.wait(30) == 0
    scenario.settings["limits"] = {"max_concurrent": CHANGED}
    refused = workers.start(concurrency=2)
    during = _send(scenario, 12)
    try:
        status = refused.wait(45)
    except subprocess.TimeoutExpired:
        raise AssertionError(
            "the worker with the changed limit kept running\n" + scenario.logs()
        ) from None

    assert status == EX_CONFIG, scenario.logs()
    log = (workers.log_dir / f"{_name(workers, refused)}.log").read_text()
    limiter = scenario.settings["limiter"]
    named = (
        f"limiter {limiter!r} is stored with different limits: max_concurrent (stored 2, given 3)"
    )
    assert log.count(named) == 1, log
    assert log.count("refuses to start") == 1, log
    for remedy in ("runcell_sync_limiters --replace", '"use_stored"', "stop every worker"):
        assert remedy in log, log
    assert "Traceback" not in log, log

    after = _send(scenario, 6)
    assert scenario.replies(before + during + after) == ["ok"] * 30, "a task failed"
    assert all(r.state == "SUCCESS" for r in before + during + after)
    assert steady.poll() is None, "the steady worker stopped"
    assert scenario.highest() <= LIMIT, f"{scenario.highest()} in flight over {LIMIT}"


def _name(workers: Any, proc: subprocess.Popen[bytes]) -> str:
    """The log file's stem: the worker's ``--hostname`` name before ``@``."""
    return workers.nodename(proc).split("@", 1)[0]


def _runcell(settings: dict[str, Any], **changes: Any) -> dict[str, Any]:
    return {**settings, "runcell": {**copy.deepcopy(settings["runcell"]), **changes}}


def _limiters(**limits: dict[str, Any]) -> dict[str, Any]:
    return {"LIMITERS": limits}


def test_the_start_check_refuses_every_conflicting_limiter_in_one_message(
    make_app, celery_settings, caplog
) -> None:
    first, second, same = (f"conflict-{uuid.uuid4().hex[:8]}" for _ in range(3))
    stored = {"max_concurrent": 2}
    registry = registry_for(
        make_app(
            **_runcell(
                celery_settings,
                **_limiters(
                    **{
                        first: stored,
                        second: stored,
                        same: stored,
                        "llm": LIMITS,
                    }
                ),
            )
        )
    )
    # Stores them ("llm" too: earlier tests of the session stored it with other limits).
    for name in (first, second, same, "llm"):
        registry.get(name)
    given = _runcell(
        celery_settings,
        LIMITERS={
            first: {"max_concurrent": 3},
            second: {"max_concurrent": 2, "max_queued": 5},
            same: stored,
            "llm": LIMITS,
        },
        POSTGRES={"on_conflict": "error"},
    )
    worker = make_app(**given)
    with (
        caplog.at_level(logging.WARNING, logger="runcell_celery"),
        pytest.raises(WorkerRefused) as refused,
    ):
        refuse_conflicting_limits(worker)
    assert refused.value.code == EX_CONFIG
    assert [c.limiter for c in refused.value.conflicts] == sorted([first, second])
    said = [r for r in caplog.records if "refuses to start" in r.getMessage()]
    assert len(said) == 1
    assert said[0].levelno == logging.CRITICAL
    message = said[0].getMessage()
    assert message == refused.value.message
    assert (
        f"limiter {first!r} is stored with different limits: max_concurrent (stored 2, given 3)"
        in message
    )
    assert (
        f"limiter {second!r} is stored with different limits: max_queued (stored None, given 5)"
        in message
    )
    assert repr(same) not in message


def test_the_start_check_refuses_nothing_under_use_stored_or_replace(
    make_app, celery_settings
) -> None:
    name = f"conflict-{uuid.uuid4().hex[:8]}"
    registry_for(
        make_app(**_runcell(celery_settings, **_limiters(**{name: {"max_concurrent": 2}})))
    ).get(name)
    for policy in ("use_stored", "replace"):
        app = make_app(
            **_runcell(
                celery_settings,
                LIMITERS={name: {"max_concurrent": 3}},
                POSTGRES={"on_conflict": policy},
            )
        )
        refuse_conflicting_limits(app)  # starts


def test_the_start_check_lets_a_worker_start_when_the_database_is_unreachable(
    make_app, celery_settings, caplog
) -> None:
    app = make_app(
        **_runcell(
            celery_settings,
            DATABASE=UNREACHABLE_DSN,
            POSTGRES={"on_conflict": "error", "connect_timeout_ms": 1_000},
        )
    )
    with caplog.at_level(logging.WARNING, logger="runcell_celery"):
        refuse_conflicting_limits(app)  # starts: the tasks retry within their budgets
    assert any("could not compare" in r.getMessage() for r in caplog.records), caplog.text
