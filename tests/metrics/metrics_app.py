"""The Celery app of ``test_prefork_scrape.py``: deferrable tasks on one limiter,
counted into Prometheus metrics by every pool process.

Built from the ``RUNCELL_TEST_METRICS`` environment variable (JSON settings) in the
worker subprocess, where it also sets ``PROMETHEUS_MULTIPROC_DIR`` to
``settings["multiproc_dir"]`` before prometheus_client is imported (the way a
deployment sets it in the worker's environment), and installs the event metrics
before the pool forks. The test process builds the same app to send tasks, without
either.

* ``metrics.call(hold_ms)`` — admission ``defer`` (10 ms admission wait): parks when
  the limiter is full; holds its slot ``hold_ms`` counted in flight in Redis
  (``<records_key>:max``: the witness of the limit).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from celery import Celery, Task

from runcell_celery import slot
from runcell_celery.celery import RunCellTask
from tests.support.witness_apps import configured_app, counted_in_flight, per_process_redis

ENV = "RUNCELL_TEST_METRICS"


def create_app(settings: dict[str, Any]) -> Celery:
    """``settings``: ``queue``, ``database``, ``limiter``, ``limits``, ``records_key``."""
    app = configured_app("runcell_metrics", settings, {settings["limiter"]: settings["limits"]})
    sink = per_process_redis()
    records = settings["records_key"]

    @app.task(
        name="metrics.call",
        shared=False,
        base=RunCellTask,
        bind=True,
        concurrency={"limiter": settings["limiter"], "admission": "defer", "admission_wait_ms": 10},
    )
    def call(self: Task[Any, Any], hold_ms: float) -> int:
        with slot(), counted_in_flight(sink(), records, "all"):
            time.sleep(hold_ms / 1000)
        return os.getpid()

    return app


def _worker_app() -> Celery | None:
    raw = os.environ.get(ENV)
    if not raw:
        return None  # the test process builds its app itself
    settings = json.loads(raw)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = settings["multiproc_dir"]
    from runcell_celery.metrics import install_event_metrics

    install_event_metrics()
    return create_app(settings)


app = _worker_app()
