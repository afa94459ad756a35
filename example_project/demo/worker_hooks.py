"""Loaded by the Celery workers under ``./demo`` (``RUNCELL_DEMO_RUN`` set).

Reports to Redis, under keys of this demo run:

* ``{run}:ready`` — a set of worker hostnames that are ready;
* ``{run}:progress`` — a hash of finished task counts (``succeeded``, ``failed``);
* ``{run}:sent`` — when each task was first sent (task id -> Unix time);
* ``{run}:records`` — a list of JSON records for the summary's waits
  (:mod:`.waits` reads them): each ``acquired`` event (run, workload, time,
  ``wait_ms``), each parked delivery (the ``task_deferred`` signal: a deferral emits
  no event) and each concurrency failure.

Loaded by the demo's own process too, which sends the workload.

Events never carry prompts or arguments, and neither does this.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery
from celery.signals import (
    before_task_publish,
    task_failure,
    task_success,
    worker_ready,
)

from runcell_celery import ConcurrencyEvent, add_event_listener
from runcell_celery.celery.signals import task_deferred

_RECORDED = {"acquired", "timed-out", "queue-full", "limiter-error", "lease-lost"}


def keys(run: str) -> dict[str, str]:
    """The Redis keys of one demo run."""
    base = f"runcell-demo:{run}"
    return {name: f"{base}:{name}" for name in ("ready", "progress", "sent", "records")}


def forget_run(redis_url: str, run: str, *, after_s: int) -> None:
    """Let Redis drop a finished run's keys after ``after_s`` seconds."""
    client = redis.Redis.from_url(redis_url)
    for key in keys(run).values():
        client.expire(key, after_s)


class _Reporter:
    def __init__(self, url: str, run: str) -> None:
        self.keys = keys(run)
        self._url = url
        self._client: redis.Redis | None = None
        self._pid = 0

    @property
    def client(self) -> redis.Redis:
        # One client per process: prefork children must not share the parent's sockets.
        if self._client is None or self._pid != os.getpid():
            self._client = redis.Redis.from_url(self._url)
            self._pid = os.getpid()
        return self._client

    def on_publish(self, headers: dict[str, Any] | None = None, **_: Any) -> None:
        task_id = (headers or {}).get("id")
        if task_id:  # a re-published (deferred) task keeps its first sending time
            self.client.hsetnx(self.keys["sent"], task_id, time.time())

    def on_deferred(
        self, task_id: str | None = None, workload: str | None = None, **_: Any
    ) -> None:
        self._record(
            {"type": "deferred", "run_id": task_id, "workload": workload, "timestamp": time.time()}
        )

    def on_event(self, event: ConcurrencyEvent) -> None:
        if event.type not in _RECORDED:
            return
        self._record(
            {
                "type": event.type,
                "run_id": event.run_id,
                "workload": event.workload,
                "timestamp": event.timestamp,
                "wait_ms": event.wait_ms,
            }
        )

    def _record(self, record: dict[str, Any]) -> None:
        self.client.rpush(self.keys["records"], json.dumps(record))

    def on_ready(self, sender: Any = None, **_: Any) -> None:
        self.client.sadd(self.keys["ready"], str(getattr(sender, "hostname", "?")))

    def on_success(self, **_: Any) -> None:
        self.client.hincrby(self.keys["progress"], "succeeded", 1)

    def on_failure(self, **_: Any) -> None:
        self.client.hincrby(self.keys["progress"], "failed", 1)


def install(app: Celery) -> None:
    """Connect the reporter (once per process)."""
    reporter = _Reporter(os.environ["RUNCELL_DEMO_REDIS_URL"], os.environ["RUNCELL_DEMO_RUN"])
    add_event_listener(reporter.on_event)
    before_task_publish.connect(reporter.on_publish, weak=False)
    task_deferred.connect(reporter.on_deferred, weak=False)
    worker_ready.connect(reporter.on_ready, weak=False)
    task_success.connect(reporter.on_success, weak=False)
    task_failure.connect(reporter.on_failure, weak=False)
    app.runcell_demo_reporter = reporter  # type: ignore[attr-defined]
