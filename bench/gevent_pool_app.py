"""The Celery app ``bench/gevent_pool.py`` runs, in its own process and in the worker.

Both sides build it with :func:`create_app` from the same settings (the worker reads
them as JSON from ``RUNCELL_BENCH_GEVENT``). It is imported by a ``celery worker -P
gevent`` after Celery monkey-patched the process: nothing here patches or imports gevent.

Tasks (limiter ``llm``, ``max_concurrent`` = ``limit``):

* ``gbench.call.wait`` and ``gbench.call.defer`` — ``with slot():`` one call to the
  fake provider lasting ``hold_ms`` (the witness counts it in flight), with admission
  ``"wait"`` or ``"defer"``; after the slot is released the task pushes one JSON record
  to Redis (host wall clock when the slot was acquired and released; whether the
  delivery was a re-publication of a parked run);
* ``gbench.warm`` — takes one slot and returns, to open the worker's pool, listener
  and keeper before a measured run.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery, Task

from runcell_celery import slot
from runcell_celery.celery import RunCellTask, headers
from runcell_celery.testing import FakeProviderClient

ENV = "RUNCELL_BENCH_GEVENT"
ADMISSIONS = ("wait", "defer")


def create_app(settings: dict[str, Any]) -> Celery:
    """Build the bench app. ``settings``: ``redis_url``, ``queue``, ``database`` (the
    worker's DSN, with its ``application_name``), ``limit``, ``postgres`` (the
    ``RUNCELL["POSTGRES"]`` options), ``provider_url``, ``records_key``."""
    url = settings["redis_url"]
    queue = settings["queue"]
    app = Celery("runcell_gevent_bench", broker=url, backend=url, set_as_current=False)
    app.conf.update(
        task_default_queue=queue,
        control_exchange=f"ctl-{queue}",
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        result_expires=3600,
        broker_transport_options={
            "unacked_key": f"{queue}-unacked",
            "unacked_index_key": f"{queue}-unacked-index",
            "unacked_mutex_key": f"{queue}-unacked-mutex",
        },
        runcell={
            "DATABASE": settings["database"],
            "LIMITERS": {"llm": {"max_concurrent": settings["limit"]}},
            "POSTGRES": settings["postgres"],
        },
    )
    provider = FakeProviderClient(settings["provider_url"], timeout=120)
    sink = redis.Redis.from_url(url)  # one process (gevent): one client, shared by greenlets

    for admission in ADMISSIONS:
        _add_call(app, provider, sink, settings["records_key"], admission)

    @app.task(
        shared=False, base=RunCellTask, bind=True, name="gbench.warm",
        concurrency={"limiter": "llm"},
    )  # fmt: skip
    def warm(self: Task[Any, Any]) -> int:
        with slot():
            pass
        return os.getpid()

    return app


def _add_call(
    app: Celery,
    provider: FakeProviderClient,
    sink: redis.Redis,
    records_key: str,
    admission: str,
) -> None:
    concurrency = {"limiter": "llm", "admission": admission}

    @app.task(
        shared=False, base=RunCellTask, bind=True, name=f"gbench.call.{admission}",
        concurrency=concurrency,
    )  # fmt: skip
    def call(self: Task[Any, Any], hold_ms: float) -> None:
        with slot():
            acquired = time.time()
            provider.create("bench", latency_ms=hold_ms)
            released = time.time()
        record = {
            "acquired": acquired,
            "released": released,
            "republished": headers.read(self.request, headers.PUBLICATION) is not None,
        }
        sink.rpush(records_key, json.dumps(record))


def _from_env() -> Celery | None:
    raw = os.environ.get(ENV)
    return create_app(json.loads(raw)) if raw else None


app = _from_env()
