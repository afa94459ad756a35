"""The Celery app of ``test_granted_queue.py``: a parked task and cheap no-op messages.

Built from the ``RUNCELL_TEST_GRANTED`` environment variable (JSON settings) in the
worker subprocess, and from the same settings in the test process. ``broker`` may be
Redis or RabbitMQ; results and records go to Redis.

* ``granted.noop`` — the backlog: pushes ``"n"`` to the records list;
* ``granted.parked`` — a deferrable task (admission ``defer``, 50 ms admission wait)
  that takes one slot of the test's limiter and pushes ``"P"`` while it holds it.
"""

from __future__ import annotations

from typing import Any

from celery import Celery, Task

from runcell_celery import slot
from runcell_celery.celery import RunCellTask
from tests.support.witness_apps import (
    REDIS_URL,
    app_from_env,
    configured_app,
    per_process_redis,
)

__all__ = ["ENV", "LIMITS", "REDIS_URL", "app", "create_app"]

ENV = "RUNCELL_TEST_GRANTED"
LIMITS = {"max_concurrent": 1, "lease_ttl_ms": 30_000, "claim_window_ms": 20_000}


def create_app(settings: dict[str, Any]) -> Celery:
    """``settings``: ``broker``, ``queue``, ``database``, ``limiter``, ``records_key``."""
    app = configured_app(
        "runcell_granted", settings, {settings["limiter"]: LIMITS}, broker=settings["broker"]
    )
    records = settings["records_key"]
    sink = per_process_redis()

    @app.task(shared=False, name="granted.noop", ignore_result=True)
    def noop() -> None:
        sink().rpush(records, "n")

    @app.task(
        shared=False, base=RunCellTask, bind=True, name="granted.parked",
        concurrency={"limiter": settings["limiter"], "admission": "defer", "admission_wait_ms": 50},
    )  # fmt: skip
    def parked(self: Task[Any, Any]) -> str:
        with slot():
            sink().rpush(records, "P")
        return "ran"

    return app


app = app_from_env(ENV, create_app)
