"""Parts of the small Celery apps the end-to-end tests run in ``celery worker``
subprocesses (``tests/celery/*_app.py``), with Redis as the witness.

* :func:`configured_app` — an app on the settings' queue and PostgreSQL database, with
  the settings every one of those apps shares;
* :func:`per_process_redis` — one Redis client per process (a prefork child never uses
  its parent's socket);
* :func:`counted_in_flight` — a task counts itself in flight (per key and in total)
  while it holds its slot, keeping the highest counts seen;
* :func:`app_from_env` — the worker's app, built from JSON settings in an environment
  variable.

Light on purpose: every worker process imports it.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from typing import Any

import redis
from celery import Celery

REDIS_URL = os.environ.get("RUNCELL_TEST_REDIS", "redis://127.0.0.1:6379/0")

#: INCR a counter and keep its highest value: KEYS = (counter, highest).
_ENTER = """
local n = redis.call('INCR', KEYS[1])
local m = tonumber(redis.call('GET', KEYS[2]) or '0')
if n > m then redis.call('SET', KEYS[2], n) end
return n
"""


def configured_app(
    name: str, settings: dict[str, Any], limiters: dict[str, Any], *, broker: str = REDIS_URL
) -> Celery:
    """An app on ``settings["queue"]`` (control exchange of its own too) with
    ``limiters`` on the PostgreSQL database ``settings["database"]``; results in Redis."""
    app = Celery(name, broker=broker, backend=REDIS_URL, set_as_current=False)
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
            "LIMITERS": limiters,
            "POSTGRES": {"poll_interval_ms": 50, "on_conflict": "replace"},
        },
    )
    return app


def per_process_redis() -> Callable[[], redis.Redis]:
    """A function returning this process's own Redis client, made on first use."""
    clients: dict[int, redis.Redis] = {}

    def client() -> redis.Redis:
        made = clients.get(os.getpid())
        if made is None:
            made = clients[os.getpid()] = redis.Redis.from_url(REDIS_URL)
        return made

    return client


@contextlib.contextmanager
def counted_in_flight(client: redis.Redis, records: str, key: str) -> Iterator[None]:
    """Count the block in flight for ``key`` and in total while it runs, keeping the
    highest counts seen (``<records>:max:<key>``, ``<records>:max``)."""
    client.eval(_ENTER, 2, f"{records}:in:{key}", f"{records}:max:{key}")
    client.eval(_ENTER, 2, f"{records}:in", f"{records}:max")
    try:
        yield
    finally:
        client.decr(f"{records}:in:{key}")
        client.decr(f"{records}:in")


def app_from_env(env: str, create_app: Callable[..., Celery], **options: Any) -> Celery | None:
    """``create_app(settings, **options)`` from the JSON settings in ``env``; ``None``
    when it is unset (the test process builds its app itself)."""
    raw = os.environ.get(env)
    return create_app(json.loads(raw), **options) if raw else None
