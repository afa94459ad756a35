"""The Celery app of ``test_rolling_limit_change.py``: a worker started with the old
limits and ``on_conflict="use_stored"`` (or the settings' ``on_conflict``), whose tasks
must keep running once the stored limits change under it.

Built from the ``RUNCELL_TEST_ROLLING`` environment variable (JSON settings) in the
worker subprocess, and from the same settings in the test process. Inside its slot
each task counts itself in flight in Redis (the witness), keeping the highest count.

* ``rolling.call(latency_ms)`` — waits for its slot (admission ``wait``);
* ``rolling.defer(latency_ms)`` — parks when there is no room (admission ``defer``).
"""

from __future__ import annotations

import time
from typing import Any

from celery import Celery, Task

from runcell_celery import slot
from runcell_celery.celery import RunCellTask
from tests.support.witness_apps import (
    app_from_env,
    configured_app,
    counted_in_flight,
    per_process_redis,
)

ENV = "RUNCELL_TEST_ROLLING"


def create_app(settings: dict[str, Any]) -> Celery:
    """``settings``: ``queue``, ``database``, ``limiter``, ``limits``, ``records_key``
    and optionally ``on_conflict`` (default ``"use_stored"``)."""
    app = configured_app("runcell_rolling", settings, {settings["limiter"]: settings["limits"]})
    app.conf.runcell["POSTGRES"]["on_conflict"] = settings.get("on_conflict", "use_stored")
    records = settings["records_key"]
    sink = per_process_redis()
    limiter = {"limiter": settings["limiter"]}

    def provider_call(latency_ms: float) -> str:
        with slot(), counted_in_flight(sink(), records, "all"):
            time.sleep(latency_ms / 1000)
        return "ok"

    @app.task(name="rolling.call", shared=False, base=RunCellTask, bind=True, concurrency=limiter)
    def call(self: Task[Any, Any], latency_ms: float) -> str:
        return provider_call(latency_ms)

    @app.task(
        name="rolling.defer",
        shared=False,
        base=RunCellTask,
        bind=True,
        concurrency={**limiter, "admission": "defer", "admission_wait_ms": 20},
    )
    def defer(self: Task[Any, Any], latency_ms: float) -> str:
        return provider_call(latency_ms)

    return app


app = app_from_env(ENV, create_app)
