"""Limits that conflict once a worker runs (another worker stored other limits after it
started under ``on_conflict="error"``): each task that meets the conflict fails with a
``config-error`` event, and the worker says so once per limiter and change, its
sweeper included, not once per task or per tick.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest

from runcell_celery import ConcurrencyConfigError
from runcell_celery.celery import registry_for
from runcell_celery.celery.deferral import Sweeper
from runcell_celery.celery.state import state_for
from tests.support.celery_fixtures import LIMITS

TASKS = 4
CHANGED = {**LIMITS, "max_concurrent": LIMITS["max_concurrent"] + 1}


def _runcell(settings: dict[str, Any], **changes: Any) -> dict[str, Any]:
    return {**settings, "runcell": {**copy.deepcopy(settings["runcell"]), **changes}}


def _erroring(settings: dict[str, Any]) -> dict[str, Any]:
    return _runcell(settings, POSTGRES={"poll_interval_ms": 50, "on_conflict": "error"})


def test_a_task_that_meets_limits_changed_after_its_worker_started_records_a_config_error_event(
    make_app, worker_processes, worker_events, celery_settings
) -> None:
    app = make_app()
    registry_for(app).get("llm")  # stores the worker's limits (on_conflict "replace" here)
    group = worker_processes(**_erroring(celery_settings))
    group.start(concurrency=1, answering=app)
    # Another worker stores other limits while this one runs.
    registry_for(make_app(limits=CHANGED)).get("llm")

    results = [app.tasks["rc.wait"].delay(5) for _ in range(TASKS)]
    for result in results:
        with pytest.raises(ConcurrencyConfigError, match="stored with different limits"):
            result.get(timeout=60)

    ids = {result.id for result in results}
    config_errors = [e for e in worker_events() if e["type"] == "config-error"]
    mine = [e for e in config_errors if e.get("run_id") in ids]
    assert sorted(e["run_id"] for e in mine) == sorted(ids), config_errors
    for event in mine:
        assert event["limiter"] == "llm"
        assert event["holder_name"] == "rc.wait"
        assert "max_concurrent (stored 4, given 3)" in event["error"]
    logs = "".join(path.read_text() for path in group.log_dir.glob("*.log"))
    assert logs.count("cannot run: limiter 'llm' is stored with different limits") == 1, logs


def test_the_sweeper_says_once_that_a_limiter_conflicts_not_at_every_tick(
    make_app, celery_settings, caplog
) -> None:
    registry_for(make_app(limits=CHANGED)).get("llm")  # the fleet's stored limits
    app = make_app(**_erroring(celery_settings))  # a worker still on the old ones
    sweeper = Sweeper(app, state_for(app).registry)
    with caplog.at_level(logging.WARNING, logger="runcell_celery"):
        for _ in range(5):
            sweeper.sweep()
    said = [r for r in caplog.records if "limiter 'llm' is stored with" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in caplog.records]
    assert "max_concurrent (stored 4, given 3)" in said[0].getMessage()

    # The conflict ends (the worker's limits are stored again), then comes back: said again.
    registry_for(make_app()).get("llm")
    sweeper.sweep()
    registry_for(make_app(limits=CHANGED)).get("llm")
    state_for(app).registry.close()  # a new process: the limiter is created afresh
    with caplog.at_level(logging.WARNING, logger="runcell_celery"):
        sweeper.sweep()
        sweeper.sweep()
    said = [r for r in caplog.records if "limiter 'llm' is stored with" in r.getMessage()]
    assert len(said) == 2, [r.getMessage() for r in caplog.records]
