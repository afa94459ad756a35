"""What the integration keeps per Celery app lives beside the app, never on it.

Several apps may share a process (these tests do), so each app's registry, counters
and wiring live in one ``AppState`` per app, dropped with the app; the loops that run
beside a worker belong to a bootstep of that worker, started and stopped with it.
"""

from __future__ import annotations

import gc
import threading
import weakref
from typing import Any

from celery import Celery
from celery.contrib.testing.worker import start_worker

from runcell_celery.celery import RunCellStep, RunCellTask, registry_for
from runcell_celery.celery.state import state_for

MEMORY = {"BACKEND": "memory", "LIMITERS": {"llm": {"max_concurrent": 1}}}


def _app_with_a_task() -> Celery:
    app = Celery("runcell-state-test", set_as_current=False)
    app.conf.runcell = MEMORY

    @app.task(base=RunCellTask, bind=True, shared=False, concurrency={"limiter": "llm"})
    def limited(self: RunCellTask) -> None:
        return None

    app.finalize()
    return app


def test_the_integration_sets_no_attribute_on_the_app() -> None:
    app = _app_with_a_task()
    before = set(vars(app))
    state = state_for(app)
    assert state.wired, "binding a RunCellTask wires its app"
    assert registry_for(app) is state.registry
    assert set(vars(app)) == before
    assert not [name for name in vars(app) if "runcell" in name]


def test_two_apps_in_one_process_keep_their_own_limiters() -> None:
    first, second = _app_with_a_task(), _app_with_a_task()
    assert state_for(first) is not state_for(second)
    assert registry_for(first).get("llm") is not registry_for(second).get("llm")


def test_an_apps_state_goes_with_the_app() -> None:
    app = _app_with_a_task()
    state = weakref.ref(state_for(app))
    gone = weakref.ref(app)
    del app
    gc.collect()
    assert gone() is None, "something keeps the app alive"
    assert state() is None, "the app's state outlived it"


def test_a_worker_of_the_app_runs_the_sweeper_in_its_bootstep_and_stops_it_with_itself(
    celery_app: Celery, celery_worker_pool: str, celery_worker_parameters: dict[str, Any]
) -> None:
    # Its tasks are bound (and it is wired) when the worker finalizes it. The worker is
    # Celery's celery_worker, started here: the test looks on after it stopped.
    def sweepers() -> int:
        return sum(1 for t in threading.enumerate() if t.name == "runcell-sweeper" and t.is_alive())

    already = sweepers()
    with start_worker(celery_app, pool=celery_worker_pool, **celery_worker_parameters) as worker:
        assert RunCellStep in celery_app.steps["worker"]
        assert any(isinstance(step, RunCellStep) for step in worker.steps)
        assert sweepers() == already + 1
    assert sweepers() == already
