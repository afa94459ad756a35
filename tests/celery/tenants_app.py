"""The Celery app of ``test_keyed_fairness.py``: a provider limit over every tenant and a
limit per tenant, ``concurrency={"limiter": [<provider>, <tenant>], "key": "{tenant_id}"}``.

Built from the ``RUNCELL_TEST_TENANTS`` environment variable (JSON settings) in the
worker subprocess, and from the same settings in the test process. Inside its slot each
task appends its tenant to the Redis list ``<records_key>:starts``: the order in which
tasks got their slots.

The provider limiter serves its line by tenant in turn (``"fairness": "round_robin"``):
in FIFO order the busy tenant's first waiting task, first in both lines, would keep the
provider's free slot for itself until its tenant had room again.

* ``tenants.wait(tenant_id, latency_ms)`` — waits for its slot (admission ``wait``);
* ``tenants.defer(tenant_id, latency_ms)`` — parks when its tenant has no room
  (admission ``defer``, 20 ms admission wait).
"""

from __future__ import annotations

import time
from typing import Any

from celery import Celery

from runcell_celery import slot
from runcell_celery.celery import RunCellTask
from tests.support.witness_apps import app_from_env, configured_app, per_process_redis

ENV = "RUNCELL_TEST_TENANTS"


def create_app(settings: dict[str, Any]) -> Celery:
    """``settings``: ``queue``, ``database``, ``records_key``, ``provider``, ``tenant``
    (the limiters' names), ``limit``, ``per_tenant``."""
    limiters = {
        settings["provider"]: {
            "max_concurrent": settings["limit"],
            "fairness": "round_robin",  # its line served by tenant in turn
            "lease_ttl_ms": 5_000,
        },
        settings["tenant"]: {
            "max_concurrent": settings["per_tenant"],
            "keyed": True,
            "lease_ttl_ms": 5_000,
        },
    }
    app = configured_app("runcell_tenants", settings, limiters)
    starts = f"{settings['records_key']}:starts"
    sink = per_process_redis()

    def provider_call(tenant_id: str, latency_ms: float) -> str:
        with slot():
            sink().rpush(starts, tenant_id)
            time.sleep(latency_ms / 1000)
        return tenant_id

    limits = {"limiter": [settings["provider"], settings["tenant"]], "key": "{tenant_id}"}

    @app.task(name="tenants.wait", shared=False, base=RunCellTask, concurrency=limits)
    def wait(tenant_id: str, latency_ms: float) -> str:
        return provider_call(tenant_id, latency_ms)

    @app.task(
        name="tenants.defer",
        shared=False,
        base=RunCellTask,
        concurrency={**limits, "admission": "defer", "admission_wait_ms": 20},
    )
    def defer(tenant_id: str, latency_ms: float) -> str:
        return provider_call(tenant_id, latency_ms)

    return app


app = app_from_env(ENV, create_app)
