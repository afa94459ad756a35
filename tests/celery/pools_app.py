"""The app of ``test_pools.py``: the test app (:mod:`tests.support.celery_app`, its
``rc.*`` tasks on limiter ``llm``, events pushed to Redis) plus ``pools.keep``.

``pools.keep`` holds a slot of limiter ``short-ttl`` (a lease TTL shorter than the hold)
while its body blocks in I/O: one call to the fake provider (a socket read) and then a
``time.sleep``, each longer than the TTL; the lease stays held only if the keeper renews
it meanwhile. Workers build the app from JSON settings in :data:`ENV`.
"""

from __future__ import annotations

import os
import time
from typing import Any

from celery import Celery

from runcell_celery import slot
from runcell_celery.celery import RunCellTask
from runcell_celery.testing import FakeProviderClient
from tests.support import celery_app
from tests.support.witness_apps import app_from_env

ENV = "RUNCELL_TEST_POOLS"


def create_app(settings: dict[str, Any]) -> Celery:
    app = celery_app.create_app(settings)
    provider = FakeProviderClient(settings["provider_url"], timeout=60)

    @app.task(
        shared=False, base=RunCellTask, bind=True, name="pools.keep",
        concurrency={"limiter": "short-ttl"},
    )  # fmt: skip
    def keep(self: RunCellTask, io_ms: float, sleep_ms: float) -> dict[str, Any]:
        with slot() as held:
            assert held.lease is not None
            provider.create("keep", latency_ms=io_ms)
            time.sleep(sleep_ms / 1000)
            return {"lease_id": held.lease.lease_id, "pid": os.getpid()}

    return app


app = app_from_env(ENV, create_app)
