"""``concurrency={...}`` is validated when the task is bound, and per-call selections too."""

from __future__ import annotations

import pytest
from celery import Celery

from runcell_celery import ConcurrencyConfigError
from runcell_celery.celery import RunCellTask


def _app(pg_dsn: str) -> Celery:
    app = Celery("options", broker="memory://", backend="cache+memory://", set_as_current=False)
    app.conf.runcell = {
        "DATABASE": pg_dsn,
        "LIMITERS": {
            "claude": {"max_concurrent": 2, "workloads": {"interactive": {}, "batch": {}}}
        },
    }
    return app


def _define(app: Celery, **concurrency: object) -> None:
    """Define a task and register it, as a worker does at startup (app finalisation)."""

    @app.task(base=RunCellTask, name="options.task", concurrency=concurrency, shared=False)
    def task() -> None:
        return None

    app.finalize(auto=True)


def test_an_unknown_limiter_fails_when_the_task_is_defined(pg_dsn: str) -> None:
    app = _app(pg_dsn)
    with pytest.raises(
        ConcurrencyConfigError, match=r"no limiter named 'claud'.*did you mean 'claude'"
    ):
        _define(app, limiter="claud")


def test_an_unknown_workload_fails_when_the_task_is_defined(pg_dsn: str) -> None:
    app = _app(pg_dsn)
    with pytest.raises(ConcurrencyConfigError, match=r"no workload 'interactiv'.*'interactive'"):
        _define(app, limiter="claude", workload="interactiv")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"limiter": "claude", "admision": "defer"}, r"\['admision'\].*did you mean 'admission'"),
        (
            {"limiter": "claude", "admission": "later"},
            r"\['admission'\] = 'later'.*'wait', 'defer'",
        ),
        ({"limiter": "claude", "hold": "run"}, r"\['hold'\] = 'run'.*'slot', 'task'"),
        (
            {"limiter": "claude", "timeout_ms": 0},
            r"\['timeout_ms'\] = 0 is invalid: must be positive",
        ),
        ({"limiter": "claude", "timeout_ms": "5s"}, r"\['timeout_ms'\] = '5s'.*must be a number"),
        (
            {"limiter": "claude", "timeout_ms": float("inf")},
            r"\['timeout_ms'\] = inf is invalid: must be at most 2147483647 ms",
        ),
        (
            {"limiter": "claude", "admission": "defer", "admission_wait_ms": 1e300},
            r"\['admission_wait_ms'\] = 1e\+300 is invalid: must be at most 2147483647 ms",
        ),
        ({"workload": "interactive"}, r"a workload needs a 'limiter'"),
    ],
)
def test_invalid_task_options_name_the_task_and_the_key(
    pg_dsn: str, options: dict[str, object], message: str
) -> None:
    with pytest.raises(ConcurrencyConfigError, match=r"task 'options.task' concurrency") as caught:
        _define(_app(pg_dsn), **options)
    assert caught.match(message)


def test_a_per_call_workload_that_does_not_exist_fails_before_sending(pg_dsn: str) -> None:
    app = _app(pg_dsn)
    _define(app, limiter="claude", workload="batch")
    task = app.tasks["options.task"]
    with pytest.raises(ConcurrencyConfigError, match=r"no workload 'urgent'"):
        task.apply_async(concurrency={"workload": "urgent"})
    with pytest.raises(ConcurrencyConfigError, match=r"\['worklaod'\].*did you mean 'workload'"):
        task.apply_async(concurrency={"worklaod": "interactive"})


def test_deferrable_tasks_are_acked_late_so_parking_commits_before_the_ack(pg_dsn: str) -> None:
    app = _app(pg_dsn)
    _define(app, limiter="claude", workload="batch", admission="defer")
    task = app.tasks["options.task"]
    assert task.acks_late is True
    assert task.reject_on_worker_lost is True


def test_a_task_without_a_limiter_outside_any_run_runs_untouched(pg_dsn: str) -> None:
    app = _app(pg_dsn)

    @app.task(base=RunCellTask, name="options.plain", shared=False)
    def plain(x: int) -> int:
        return x + 1

    assert plain(41) == 42
    assert plain.apply((1,)).get() == 2
