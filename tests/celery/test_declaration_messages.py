"""Errors about a task's ``concurrency`` name the task, where it is declared and what to
change: Celery binds tasks when the app is finalised (a worker starting), far from the
decorator, so the message has to lead back to the declaration."""

from __future__ import annotations

import os
import traceback
from pathlib import Path

import pytest
from celery import Celery

from runcell_celery import ConcurrencyConfigError, slot
from runcell_celery.celery import RunCellTask
from runcell_celery.errors import ConcurrencyNoLimiterError

HERE = os.path.relpath(__file__)


def _line_of(text: str) -> int:
    """The line of this file that starts with ``text`` (where a task's body begins)."""
    lines = Path(__file__).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if line.startswith(text))


def _app() -> Celery:
    app = Celery("messages", broker="memory://", backend="cache+memory://", set_as_current=False)
    app.conf.runcell = {
        "BACKEND": "memory",
        "LIMITERS": {"llm": {"max_concurrent": 2, "workloads": {"background": {}, "batch": {}}}},
    }
    return app


def test_an_unknown_workload_names_the_task_where_it_is_declared_and_the_setting() -> None:
    app = _app()

    @app.task(base=RunCellTask, name="agents.answer", shared=False,
              concurrency={"limiter": "llm", "workload": "interactive"})  # fmt: skip
    def answer() -> None:
        return None

    line = _line_of('    @app.task(base=RunCellTask, name="agents.answer"')
    with pytest.raises(ConcurrencyConfigError) as caught:
        app.finalize(auto=True)
    message = str(caught.value)
    assert message.startswith("task 'agents.answer' concurrency['workload'] = 'interactive'")
    assert message.endswith(f"(task declared at {HERE}:{line})")
    assert "limiter 'llm' has no workload 'interactive'" in message
    assert "valid: 'background', 'batch'" in message
    assert 'app.conf.runcell["LIMITERS"]["llm"]["workloads"]' in message  # the setting


def test_an_unknown_limiter_names_the_task_and_where_it_is_declared() -> None:
    app = _app()

    @app.task(base=RunCellTask, name="agents.summarize", shared=False,
              concurrency={"limiter": "lm"})  # fmt: skip
    def summarize() -> None:
        return None

    with pytest.raises(ConcurrencyConfigError) as caught:
        app.finalize(auto=True)
    message = str(caught.value)
    assert message.startswith("task 'agents.summarize' concurrency['limiter']")
    assert f"(task declared at {HERE}:" in message
    assert "no limiter named 'lm' in app.conf.runcell[\"LIMITERS\"]" in message
    assert "did you mean 'llm'" in message


def test_slot_in_a_task_that_declares_no_limiter_says_the_task_declares_none() -> None:
    app = _app()

    @app.task(base=RunCellTask, name="agents.plan", shared=False, concurrency={})
    def plan() -> None:
        with slot():
            pass

    app.finalize(auto=True)
    result = plan.apply()
    error = result.result
    assert isinstance(error, ConcurrencyNoLimiterError)
    message = str(error)
    assert message.startswith(f"task 'agents.plan' ({HERE}:")
    assert "concurrency={} declares no 'limiter'" in message
    assert "concurrency={'limiter': 'llm'}" in message
    assert "or a RunCellTask" not in message  # it is one
    # The traceback still leads to the slot() call in the task's body.
    assert any(frame.name == "plan" for frame in traceback.extract_tb(error.__traceback__))
