"""The Celery app of ``test_preadmission.py``: deferrable tasks that show what their
body sees when admission is decided before it runs.

Built from the ``RUNCELL_TEST_PREADMISSION`` environment variable (JSON settings) in
the worker subprocess, and from the same settings in the test process. Every task is
deferrable (``admission: defer``, 20 ms admission wait) on the test's own limiter;
each records what it saw in Redis lists named ``<records_key>:<what>``.

* ``pre.side_effect`` — counts a side effect before its first ``slot()`` (``before``),
  holds a slot around a provider call, and records whatever its ``try``/``except
  BaseException``/``finally`` around that slot saw (``caught``, ``finally``); returns
  the pre-admitted lease's fencing token and the adopted slot's;
* ``pre.no_slot`` — never calls ``slot()``: records that it started, waits for the
  test's ``gate`` list, returns;
* ``pre.gated_slot`` — records its pid and pre-admitted lease id, waits for the
  ``gate`` list, then enters ``slot()`` and records ``guarded`` inside it.
"""

from __future__ import annotations

import json
import os
from typing import Any

from celery import Celery, Task

from runcell_celery import ConcurrencyEvent, add_event_listener, current_run, slot
from runcell_celery.celery import RunCellTask
from runcell_celery.testing import FakeProviderClient
from tests.support.witness_apps import app_from_env, configured_app, per_process_redis

ENV = "RUNCELL_TEST_PREADMISSION"


def _pre_admitted() -> tuple[str, int]:
    """The lease id and fencing token of this run's pre-admitted first slot."""
    context = current_run()
    assert context is not None
    assert context.admission is not None
    admitted = context.admission.admitted
    assert admitted is not None, "the body started without a pre-admitted slot"
    return admitted.lease.lease_id, admitted.lease.fencing_token


def create_app(settings: dict[str, Any]) -> Celery:
    """``settings``: ``queue``, ``database``, ``limiter``, ``limits``, ``records_key``,
    ``provider_url``."""
    app = configured_app(
        "runcell_preadmission", settings, {settings["limiter"]: settings["limits"]}
    )
    records = settings["records_key"]
    limiter = settings["limiter"]
    provider = FakeProviderClient(settings["provider_url"], timeout=60)
    sink = per_process_redis()

    def record(what: str, value: object) -> None:
        sink().rpush(f"{records}:{what}", json.dumps(value))

    def on_event(event: ConcurrencyEvent) -> None:
        if event.limiter == limiter:
            record("events", event.to_dict())

    add_event_listener(on_event)
    options: dict[str, Any] = {
        "shared": False,
        "base": RunCellTask,
        "bind": True,
        "concurrency": {"limiter": limiter, "admission": "defer", "admission_wait_ms": 20},
    }

    @app.task(name="pre.side_effect", **options)
    def side_effect(self: Task[Any, Any], latency_ms: float = 30) -> dict[str, Any]:
        sink().incr(f"{records}:before")  # work before the first slot() call
        pre_admitted = _pre_admitted()
        try:
            with slot() as held:
                provider.create(
                    "preadmitted",
                    latency_ms=latency_ms,
                    fencing_token=held.fencing_token,
                    limiter=limiter,
                )
                lease = held.lease
                assert lease is not None
        except BaseException as exc:
            record("caught", type(exc).__name__)
            raise
        finally:
            record("finally", self.request.id)
        return {
            "pre_admitted": list(pre_admitted),
            "adopted": [lease.lease_id, held.fencing_token],
            "retries": self.request.retries,
        }

    @app.task(name="pre.no_slot", **options)
    def no_slot(self: Task[Any, Any]) -> str:
        record("started", _pre_admitted()[0])
        sink().blpop([f"{records}:gate"], timeout=60)
        return "done"

    @app.task(name="pre.gated_slot", **options)
    def gated_slot(self: Task[Any, Any]) -> str:
        record("pre_admitted", {"pid": os.getpid(), "lease_id": _pre_admitted()[0]})
        sink().blpop([f"{records}:gate"], timeout=60)
        with slot():
            record("guarded", self.request.id)
        return "done"

    return app


app = app_from_env(ENV, create_app)
