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
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery, Task

from runcell_celery import ConcurrencyEvent, add_event_listener, current_run, slot
from runcell_celery.celery import RunCellTask

ENV = "RUNCELL_TEST_SEVERAL"
REDIS_URL = os.environ.get("RUNCELL_TEST_REDIS", "redis://127.0.0.1:6379/0")
TASK = "several.call"

#: INCR a counter and keep its highest value: KEYS = (counter, highest).
_ENTER = """
local n = redis.call('INCR', KEYS[1])
local m = tonumber(redis.call('GET', KEYS[2]) or '0')
if n > m then redis.call('SET', KEYS[2], n) end
return n
"""


def concurrency(settings: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """The task's ``concurrency`` option over the settings' two limiters."""
    return {"limiter": [settings["provider"], settings["tenant"]], "key": "{tenant_id}", **extra}


def create_app(settings: dict[str, Any], *, record_events: bool = False) -> Celery:
    """``settings``: ``queue``, ``database``, ``provider`` and ``tenant`` (limiter names),
    ``provider_limits``, ``tenant_limits``, ``records_key``. ``record_events``: push this
    process's concurrency events to ``<records_key>:events`` (the worker does)."""
    app = Celery("runcell_several", broker=REDIS_URL, backend=REDIS_URL, set_as_current=False)
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
            "LIMITERS": {
                settings["provider"]: settings["provider_limits"],
                settings["tenant"]: settings["tenant_limits"],
            },
            "POSTGRES": {"poll_interval_ms": 50, "on_conflict": "replace"},
        },
    )
    records = settings["records_key"]
    sinks: dict[int, redis.Redis] = {}

    def sink() -> redis.Redis:
        # One client per process: a prefork child never uses its parent's socket.
        client = sinks.get(os.getpid())
        if client is None:
            client = sinks[os.getpid()] = redis.Redis.from_url(REDIS_URL)
        return client

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
        with slot() as held:
            client = sink()
            client.eval(_ENTER, 2, f"{records}:in:{tenant_id}", f"{records}:max:{tenant_id}")
            client.eval(_ENTER, 2, f"{records}:in", f"{records}:max")
            try:
                time.sleep(latency_ms / 1000)
            finally:
                client.decr(f"{records}:in:{tenant_id}")
                client.decr(f"{records}:in")
            context = current_run()
            assert context is not None
            return {
                "limiters": [limiter.name for limiter in context.limiters],
                "leases": [lease.limiter for lease in held.leases],
                "key": context.key,
            }

    return app


def _from_env() -> Celery | None:
    raw = os.environ.get(ENV)
    return create_app(json.loads(raw), record_events=True) if raw else None


app = _from_env()
