"""The Celery app of ``test_several_limiters_end_to_end.py``: a task over two PostgreSQL
limiters, ``concurrency={"limiter": [<provider>, <tenant>], "key": "{tenant_id}"}``,
where the tenant limiter is keyed.

Built from the ``RUNCELL_TEST_SEVERAL`` environment variable (JSON settings) in the
worker subprocess, and from the same settings in the test process. The witness is
Redis, not the limiter: inside its slot every task counts itself in flight for its
tenant and in total (``INCR``/``DECR``), keeping the highest counts seen
(``<records_key>:max:<tenant>``, ``<records_key>:max``). Every concurrency event of the
worker's processes is pushed to the Redis list ``<records_key>:events``.

* ``several.call(tenant_id, latency_ms)`` — waits for its slot (admission ``wait``) in
  the provider limiter and in its tenant's key limiter together, and returns the names
  of the run's limiters, of its slot's leases and its key.
* ``several.deferred(tenant_id, latency_ms)`` — the same with admission ``defer``
  (``admission_wait_ms`` 0: a run that finds no room in both parks at once, as one
  request over both limiters), and it also returns its fencing tokens.
"""

from __future__ import annotations

import json
import time
from typing import Any

from celery import Celery, Task

from runcell_celery import ConcurrencyEvent, add_event_listener, current_run, slot
from runcell_celery.celery import RunCellTask
from tests.support.witness_apps import (
    app_from_env,
    configured_app,
    counted_in_flight,
    per_process_redis,
)

ENV = "RUNCELL_TEST_SEVERAL"
TASK = "several.call"
DEFERRED_TASK = "several.deferred"


def concurrency(settings: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """The task's ``concurrency`` option over the settings' two limiters."""
    return {"limiter": [settings["provider"], settings["tenant"]], "key": "{tenant_id}", **extra}


def create_app(settings: dict[str, Any], *, record_events: bool = False) -> Celery:
    """``settings``: ``queue``, ``database``, ``provider`` and ``tenant`` (limiter names),
    ``provider_limits``, ``tenant_limits``, ``records_key``. ``record_events``: push this
    process's concurrency events to ``<records_key>:events`` (the worker does)."""
    limiters = {
        settings["provider"]: settings["provider_limits"],
        settings["tenant"]: settings["tenant_limits"],
    }
    app = configured_app("runcell_several", settings, limiters)
    records = settings["records_key"]
    sink = per_process_redis()

    if record_events:

        def record(event: ConcurrencyEvent) -> None:
            sink().rpush(f"{records}:events", json.dumps(event.to_dict()))

        add_event_listener(record)

    @app.task(
        name=TASK,
        shared=False,
        base=RunCellTask,
        bind=True,
        concurrency=concurrency(settings),
    )
    def call(self: Task[Any, Any], tenant_id: str, latency_ms: float = 50) -> dict[str, Any]:
        return _held(tenant_id, latency_ms)

    @app.task(
        name=DEFERRED_TASK,
        shared=False,
        base=RunCellTask,
        concurrency=concurrency(settings, admission="defer", admission_wait_ms=0),
    )
    def deferred(tenant_id: str, latency_ms: float = 50) -> dict[str, Any]:
        return _held(tenant_id, latency_ms)

    def _held(tenant_id: str, latency_ms: float) -> dict[str, Any]:
        with slot() as held:
            with counted_in_flight(sink(), records, tenant_id):
                time.sleep(latency_ms / 1000)
            context = current_run()
            assert context is not None
            return {
                "limiters": [limiter.name for limiter in context.limiters],
                "leases": [lease.limiter for lease in held.leases],
                "key": context.key,
                "tokens": held.fencing_tokens,
            }

    return app


app = app_from_env(ENV, create_app, record_events=True)
