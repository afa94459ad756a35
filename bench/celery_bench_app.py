"""The Celery app ``bench/celery_overhead.py`` runs, in its own process and in workers.

Both sides build it with :func:`create_app` from the same settings, so the bench and
the ``celery worker`` subprocesses agree on task names and limits. A worker gets its
settings from the ``RUNCELL_BENCH_CELERY`` environment variable (JSON) and is started
as ``celery -A celery_bench_app:app worker ...`` with ``bench/`` on ``PYTHONPATH``.

Tasks:

* ``bench.bare_noop`` — a bare Celery task that does nothing;
* ``bench.rc_noop`` — a ``RunCellTask`` whose body takes one slot and does nothing
  (limiter ``noop``, never contended);
* ``bench.filler`` — the cheap unrelated messages of the backlog (no result stored);
* ``bench.hold.<variant>`` — ``with slot(): time.sleep(hold_ms / 1000)`` on limiter
  ``sat-<variant>`` with the variant's admission; it pushes one JSON record per
  completed run to Redis (host wall clock: body start, slot acquired, hold ended, done;
  the lease id; whether this delivery was a re-publication of a parked run). The record
  is written after the slot is released, so it does not lengthen the hold;
* ``bench.warm.<variant>`` — takes one slot of ``sat-<variant>`` and returns, to open
  each pool process's limiter and connections before a measured run.

When a worker is ready it sets ``<ready_key>:<hostname>`` in Redis.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery, Task
from celery.signals import worker_ready

from runcell_celery import slot
from runcell_celery.celery import RunCellTask

ENV = "RUNCELL_BENCH_CELERY"

#: The saturated run's variants: admission, whether a backlog is queued first, and
#: ``admission_wait_ms`` (``None``: left out, the library's default is used). The
#: ``defer_wait50`` pair is extra: a short wait, as the tests use, so that runs park.
VARIANTS: dict[str, dict[str, Any]] = {
    "wait": {"admission": "wait", "backlog": False, "admission_wait_ms": None},
    "wait_backlog": {"admission": "wait", "backlog": True, "admission_wait_ms": None},
    "defer": {"admission": "defer", "backlog": False, "admission_wait_ms": None},
    "defer_backlog": {"admission": "defer", "backlog": True, "admission_wait_ms": None},
    "defer_wait50": {"admission": "defer", "backlog": False, "admission_wait_ms": 50},
    "defer_wait50_backlog": {"admission": "defer", "backlog": True, "admission_wait_ms": 50},
}

_redis: dict[int, redis.Redis] = {}


def _sink(url: str) -> redis.Redis:
    """This process's Redis client (one per pid: prefork children make their own)."""
    client = _redis.get(os.getpid())
    if client is None:
        client = _redis[os.getpid()] = redis.Redis.from_url(url)
    return client


def _was_republished(request: Any) -> bool | None:
    """Whether this delivery is a re-publication of a parked run (``None``: unknown)."""
    try:
        from runcell_celery.celery import headers
    except ImportError:
        return None
    name = getattr(headers, "PUBLICATION", None)
    if name is None:
        return None
    return headers.read(request, name) is not None


def records_key(settings: dict[str, Any], variant: str) -> str:
    return f"{settings['records_key']}:{variant}"


def create_app(settings: dict[str, Any]) -> Celery:
    """Build the bench app.

    ``settings``: ``redis_url``, ``queue``, ``control_exchange``, ``database``,
    ``limit`` (the saturated limiters' ``max_concurrent``), ``prefetch``,
    ``records_key``, ``ready_key``.
    """
    url = settings["redis_url"]
    queue = settings["queue"]
    app = Celery("runcell_bench", broker=url, backend=url, set_as_current=False)
    limiters: dict[str, Any] = {"noop": {"max_concurrent": 8}}
    for variant in VARIANTS:
        limiters[f"sat-{variant}"] = {"max_concurrent": settings["limit"]}
    app.conf.update(
        task_default_queue=queue,
        # Remote control (pausing consumers) on an exchange of this run's own.
        control_exchange=settings["control_exchange"],
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        worker_prefetch_multiplier=settings["prefetch"],
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        result_expires=3600,
        # Unacked bookkeeping of this run's own, deleted with its queue.
        broker_transport_options={
            "unacked_key": f"{queue}-unacked",
            "unacked_index_key": f"{queue}-unacked-index",
            "unacked_mutex_key": f"{queue}-unacked-mutex",
        },
        runcell={"DATABASE": settings["database"], "LIMITERS": limiters},
    )

    @app.task(shared=False, name="bench.bare_noop")
    def bare_noop() -> None:
        return None

    @app.task(shared=False, name="bench.filler", ignore_result=True)
    def filler() -> None:
        return None

    @app.task(
        shared=False, base=RunCellTask, bind=True, name="bench.rc_noop",
        concurrency={"limiter": "noop"},
    )  # fmt: skip
    def rc_noop(self: Task[Any, Any]) -> None:
        with slot():
            pass

    for variant, shape in VARIANTS.items():
        concurrency = {"limiter": f"sat-{variant}", "admission": shape["admission"]}
        if shape["admission_wait_ms"] is not None:
            concurrency["admission_wait_ms"] = shape["admission_wait_ms"]
        _add_variant(app, settings, variant, concurrency)

    @worker_ready.connect(weak=False)
    def announce(sender: Any = None, **_: Any) -> None:
        hostname = getattr(sender, "hostname", None) or str(os.getpid())
        _sink(url).set(f"{settings['ready_key']}:{hostname}", "1", ex=3600)

    return app


def _add_variant(
    app: Celery, settings: dict[str, Any], variant: str, concurrency: dict[str, Any]
) -> None:
    url = settings["redis_url"]
    key = records_key(settings, variant)
    limiter = concurrency["limiter"]

    @app.task(
        shared=False, base=RunCellTask, bind=True, name=f"bench.hold.{variant}",
        concurrency=concurrency,
    )  # fmt: skip
    def hold(self: Task[Any, Any], hold_ms: float) -> None:
        body_start = time.time()
        with slot() as held:
            acquired = time.time()
            time.sleep(hold_ms / 1000)
            released = time.time()
            lease = held.lease
        done = time.time()
        record = {
            "task_id": self.request.id,
            "body_start": body_start,
            "acquired": acquired,
            "released": released,
            "done": done,
            "lease_id": lease.lease_id if lease is not None else None,
            "republished": _was_republished(self.request),
            "retries": self.request.retries,
            "pid": os.getpid(),
        }
        _sink(url).rpush(key, json.dumps(record))

    @app.task(
        shared=False, base=RunCellTask, bind=True, name=f"bench.warm.{variant}",
        concurrency={"limiter": limiter},
    )  # fmt: skip
    def warm(self: Task[Any, Any], hold_ms: float = 20) -> int:
        with slot():
            time.sleep(hold_ms / 1000)
        return os.getpid()


def _from_env() -> Celery | None:
    raw = os.environ.get(ENV)
    return create_app(json.loads(raw)) if raw else None


app = _from_env()
