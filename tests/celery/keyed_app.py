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

import time
from typing import Any

from celery import Celery, Task

from runcell_celery import current_run, slot
from runcell_celery.celery import RunCellTask
from tests.support.witness_apps import (
    app_from_env,
    configured_app,
    counted_in_flight,
    per_process_redis,
)

ENV = "RUNCELL_TEST_KEYED"


def create_app(settings: dict[str, Any]) -> Celery:
    """``settings``: ``queue``, ``database``, ``limiter``, ``limits``, ``records_key``."""
    app = configured_app("runcell_keyed", settings, {settings["limiter"]: settings["limits"]})
    records = settings["records_key"]
    sink = per_process_redis()

    def provider_call(tenant_id: str, latency_ms: float) -> dict[str, Any]:
        with slot() as held:
            with counted_in_flight(sink(), records, tenant_id):
                time.sleep(latency_ms / 1000)
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


app = app_from_env(ENV, create_app)
