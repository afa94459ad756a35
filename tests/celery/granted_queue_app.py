"""The Celery app of ``test_granted_queue.py``: a parked task and cheap no-op messages.

Built from the ``RUNCELL_TEST_GRANTED`` environment variable (JSON settings) in the
worker subprocess, and from the same settings in the test process. ``broker`` may be
Redis or RabbitMQ; results and records go to Redis.

* ``granted.noop`` — the backlog: pushes ``"n"`` to the records list;
* ``granted.parked`` — a deferrable task (admission ``defer``, 50 ms admission wait)
  that takes one slot of the test's limiter and pushes ``"P"`` while it holds it.
"""

from __future__ import annotations

import json
import os
from typing import Any

import redis
from celery import Celery, Task

from runcell_celery import slot
from runcell_celery.celery import RunCellTask

ENV = "RUNCELL_TEST_GRANTED"
REDIS_URL = os.environ.get("RUNCELL_TEST_REDIS", "redis://127.0.0.1:6379/0")
LIMITS = {"max_concurrent": 1, "lease_ttl_ms": 30_000, "claim_window_ms": 20_000}


def create_app(settings: dict[str, Any]) -> Celery:
    """``settings``: ``broker``, ``queue``, ``database``, ``limiter``, ``records_key``."""
    app = Celery(
        "runcell_granted", broker=settings["broker"], backend=REDIS_URL, set_as_current=False
    )
    app.conf.update(
        task_default_queue=settings["queue"],
        control_exchange=f"ctl-{settings['queue']}",
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        result_expires=600,
        runcell={
            "DATABASE": settings["database"],
            "LIMITERS": {settings["limiter"]: LIMITS},
            "POSTGRES": {"poll_interval_ms": 50, "on_conflict": "replace"},
        },
    )
    records = settings["records_key"]
    sinks: dict[int, redis.Redis] = {}

    def sink() -> redis.Redis:
        client = sinks.get(os.getpid())
        if client is None:
            client = sinks[os.getpid()] = redis.Redis.from_url(REDIS_URL)
        return client

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


def _from_env() -> Celery | None:
    raw = os.environ.get(ENV)
    return create_app(json.loads(raw)) if raw else None


app = _from_env()
