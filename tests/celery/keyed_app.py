"""The Celery app of ``test_keyed_task_end_to_end.py``: tasks limited per tenant by a
keyed PostgreSQL limiter, ``concurrency={"limiter": <keyed>, "key": "{tenant_id}"}``.

Built from the ``RUNCELL_TEST_KEYED`` environment variable (JSON settings) in the
worker subprocess, and from the same settings in the test process. The witness is
Redis, not the limiter: inside its slot every task counts itself in flight for its
tenant and in total (``INCR``/``DECR``), keeping the highest counts seen
(``<records_key>:max:<tenant>``, ``<records_key>:max``).

* ``keyed.call(tenant_id, latency_ms)`` — waits for its slot (admission ``wait``);
* ``keyed.defer(tenant_id, latency_ms)`` — parks when its tenant has no room
  (admission ``defer``, 20 ms admission wait).

Both return the name of the limiter their slot was in (and of their lease's).

* ``keyed.parent(tenant_id)`` — sends ``keyed.child`` (no limiter of its own: it
  inherits its parent's, the tenant's key limiter) from inside its run and returns
  the child's id.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import redis
from celery import Celery, Task

from runcell_celery import current_run, slot
from runcell_celery.celery import RunCellTask

ENV = "RUNCELL_TEST_KEYED"
REDIS_URL = os.environ.get("RUNCELL_TEST_REDIS", "redis://127.0.0.1:6379/0")

#: INCR a counter and keep its highest value: KEYS = (counter, highest).
_ENTER = """
local n = redis.call('INCR', KEYS[1])
local m = tonumber(redis.call('GET', KEYS[2]) or '0')
if n > m then redis.call('SET', KEYS[2], n) end
return n
"""


def create_app(settings: dict[str, Any]) -> Celery:
    """``settings``: ``queue``, ``database``, ``limiter``, ``limits``, ``records_key``."""
    app = Celery("runcell_keyed", broker=REDIS_URL, backend=REDIS_URL, set_as_current=False)
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
            "LIMITERS": {settings["limiter"]: settings["limits"]},
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

    def provider_call(tenant_id: str, latency_ms: float) -> dict[str, Any]:
        with slot() as held:
            client = sink()
            client.eval(_ENTER, 2, f"{records}:in:{tenant_id}", f"{records}:max:{tenant_id}")
            client.eval(_ENTER, 2, f"{records}:in", f"{records}:max")
            try:
                time.sleep(latency_ms / 1000)
            finally:
                client.decr(f"{records}:in:{tenant_id}")
                client.decr(f"{records}:in")
            assert held.lease is not None
            context = current_run()
            assert context is not None
            assert context.limiter is not None
            return {"limiter": context.limiter.name, "lease_limiter": held.lease.limiter}

    key = {"limiter": settings["limiter"], "key": "{tenant_id}"}

    @app.task(name="keyed.call", shared=False, base=RunCellTask, bind=True, concurrency=key)
    def call(self: Task[Any, Any], tenant_id: str, latency_ms: float = 50) -> dict[str, Any]:
        return provider_call(tenant_id, latency_ms)

    @app.task(
        name="keyed.defer",
        shared=False,
        base=RunCellTask,
        bind=True,
        concurrency={**key, "admission": "defer", "admission_wait_ms": 20},
    )
    def defer(self: Task[Any, Any], tenant_id: str, latency_ms: float = 50) -> dict[str, Any]:
        return provider_call(tenant_id, latency_ms)

    @app.task(name="keyed.parent", shared=False, base=RunCellTask, bind=True, concurrency=key)
    def parent(self: Task[Any, Any], tenant_id: str) -> str:
        return str(child.delay(tenant_id).id)

    @app.task(name="keyed.child", shared=False, base=RunCellTask, bind=True)
    def child(self: Task[Any, Any], tenant_id: str) -> dict[str, Any]:
        return provider_call(tenant_id, 10)

    return app


def _from_env() -> Celery | None:
    raw = os.environ.get(ENV)
    return create_app(json.loads(raw)) if raw else None


app = _from_env()
