"""The Celery app the Celery tests run: in-process workers and ``celery worker`` subprocesses.

Both sides configure it with :func:`celery_conf` and define its tasks with
:func:`register_tasks`, from the same settings, so the test process and the worker
processes agree on task names and limits. :func:`create_app` does both on a new app;
Celery's ``celery_app`` fixture (``tests.support.celery_fixtures``) is configured from
:func:`celery_conf` and gets its tasks after. A worker subprocess gets its settings from
the ``RUNCELL_TEST_CELERY`` environment variable (JSON) and is started as
``celery -A tests.support.celery_app:app worker ...``.

Every concurrency event of a worker is pushed to a Redis list (``events_key``), so a
test can see what happened inside worker processes; the fake provider counts the
provider calls. A worker started with ``clock_skew_s`` in its settings runs with its
host clock (``time.time``) that far off the database's, as a host whose NTP drifted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import time
import uuid
import weakref
from collections.abc import Callable
from typing import Any

import psutil
import redis
from celery import Celery
from celery.exceptions import SoftTimeLimitExceeded
from celery.result import allow_join_result

from runcell_celery import (
    ConcurrencyEvent,
    ConcurrencyLimiterError,
    add_event_listener,
    current_run,
    slot,
)
from runcell_celery.celery import RunCellTask, registry_for
from runcell_celery.celery.state import state_for
from runcell_celery.postgres import PostgresBackend, PostgresConcurrencyLimiter
from runcell_celery.testing import FakeProviderClient

REDIS_URL = os.environ.get("RUNCELL_TEST_REDIS", "redis://127.0.0.1:6379/0")
ENV = "RUNCELL_TEST_CELERY"

#: The event listener each app added (pushing events to Redis), to remove after a test.
EVENT_RECORDERS: weakref.WeakKeyDictionary[Celery, Callable[[ConcurrencyEvent], None]] = (
    weakref.WeakKeyDictionary()
)


@dataclasses.dataclass(frozen=True)
class Parcel:
    """A value of a class of this module: only pickle carries it (and only to a worker
    that imports the class), so it shows a parked message was never re-encoded."""

    label: str
    sizes: frozenset[int]


def _run_info() -> dict[str, Any]:
    context = current_run()
    assert context is not None
    remaining = context.remaining_ms()
    return {
        "run_id": context.run_id,
        "root_run_id": context.root_run_id,
        "parent_run_id": context.parent_run_id,
        "limiter": context.limiter.name if context.limiter is not None else None,
        "workload": context.workload,
        "remaining_ms": remaining,
        "pid": os.getpid(),
    }


def skew_clock(seconds: float) -> None:
    """Make this process's wall clock (``time.time``) read ``seconds`` off the real one.

    Done when the worker imports this module, before its pool forks, so every worker
    process of it is skewed alike. The monotonic clock is left alone: it never claims
    to agree with another host.
    """
    real_time, real_time_ns = time.time, time.time_ns
    time.time = lambda: real_time() + seconds
    time.time_ns = lambda: real_time_ns() + int(seconds * 1e9)


def database_ports(pid: int, server_port: int) -> set[int]:
    """The local ports of the TCP connections process ``pid`` holds to the database."""
    return {
        c.laddr.port
        for c in psutil.Process(pid).net_connections(kind="tcp")
        if c.raddr and c.raddr.port == server_port and c.status == psutil.CONN_ESTABLISHED
    }


def celery_conf(settings: dict[str, Any]) -> dict[str, Any]:
    """The Celery configuration of the test app: Redis broker and results, the test's
    queue, its ``runcell`` dict, then the settings' own ``conf`` overrides.

    ``settings``: ``queue`` (unique per test), ``runcell`` (the ``app.conf.runcell``
    dict) and optional Celery ``conf`` overrides.
    """
    conf = {
        "broker_url": REDIS_URL,
        "result_backend": REDIS_URL,
        "task_default_queue": settings["queue"],
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "worker_prefetch_multiplier": 1,
        "broker_connection_retry_on_startup": True,
        "worker_hijack_root_logger": False,
        "result_expires": 600,
        # Unacked bookkeeping of our own: a worker killed by another test must not
        # leave a restore mutex that delays ours.
        "broker_transport_options": {
            "visibility_timeout": 30,
            "unacked_key": f"{settings['queue']}-unacked",
            "unacked_index_key": f"{settings['queue']}-unacked-index",
            "unacked_mutex_key": f"{settings['queue']}-unacked-mutex",
            "unacked_mutex_expire": 30,
            # Sweep for the unacked messages of a killed worker every 2 s, not 100 s.
            "unacked_restore_interval": 2,
            "unacked_restore_throttle": 1,
        },
        "runcell": settings["runcell"],
    }
    return {**conf, **settings.get("conf", {})}


def create_app(settings: dict[str, Any]) -> Celery:
    """Build the test app: :func:`celery_conf` on a new app, then :func:`register_tasks`.

    ``settings``: those of both (``queue``, ``runcell``, ``provider_url``,
    ``events_key``, optional ``conf``).
    """
    app = Celery("runcell_tests", set_as_current=False)
    app.conf.update(celery_conf(settings))
    register_tasks(app, settings)
    return app


def register_tasks(app: Celery, settings: dict[str, Any]) -> None:
    """Define the test tasks (``rc.*``) on ``app``, however it was configured (by
    :func:`create_app`, or Celery's ``celery_app`` fixture from :func:`celery_conf`).

    ``settings``: ``provider_url`` (the fake provider the tasks call) and, optionally,
    ``events_key``: the Redis list every concurrency event of this process is pushed
    to from now on (the listener is kept in :data:`EVENT_RECORDERS`, for the fixture
    that made the app to remove).
    """
    provider = FakeProviderClient(settings.get("provider_url", "http://127.0.0.1:9"), timeout=60)
    events_key = settings.get("events_key")
    if events_key:
        sink = redis.Redis.from_url(REDIS_URL)

        def record(event: ConcurrencyEvent) -> None:
            sink.rpush(events_key, json.dumps(event.to_dict()))

        add_event_listener(record)
        EVENT_RECORDERS[app] = record  # removed by the fixture

    def call_provider(latency_ms: float) -> dict[str, Any]:
        with slot() as held:
            assert held.lease is not None
            provider.create("summarize", latency_ms=latency_ms)
            return {"fencing_token": held.fencing_token, "workload": held.lease.workload}

    @app.task(
        shared=False, base=RunCellTask, bind=True, name="rc.wait", concurrency={"limiter": "llm"}
    )
    def wait_task(self: RunCellTask, latency_ms: float = 10) -> dict[str, Any]:
        return {**call_provider(latency_ms), **_run_info(), "retries": self.request.retries}

    @app.task(
        shared=False,
        base=RunCellTask,
        bind=True,
        name="rc.defer",
        concurrency={"limiter": "llm", "admission": "defer", "admission_wait_ms": 50},
    )
    def defer_task(self: RunCellTask, latency_ms: float = 10) -> dict[str, Any]:
        return {**call_provider(latency_ms), **_run_info(), "retries": self.request.retries}

    @app.task(
        shared=False,
        base=RunCellTask,
        bind=True,
        name="rc.background",
        concurrency={
            "limiter": "llm",
            "workload": "background",
            "admission": "defer",
            "admission_wait_ms": 50,
        },
    )
    def background_task(self: RunCellTask, latency_ms: float = 10) -> dict[str, Any]:
        started = time.time()
        result = call_provider(latency_ms)
        return {**result, **_run_info(), "started": started, "granted": time.time()}

    @app.task(
        shared=False,
        base=RunCellTask,
        bind=True,
        name="rc.hold_task",
        concurrency={"limiter": "llm", "hold": "task"},
    )
    def hold_task(self: RunCellTask, latency_ms: float = 10) -> dict[str, Any]:
        provider.create("whole task", latency_ms=latency_ms)
        return _run_info()

    @app.task(
        shared=False,
        base=RunCellTask,
        bind=True,
        name="rc.flaky",
        concurrency={"limiter": "llm", "timeout_ms": 200},
        autoretry_for=(Exception,),
        max_retries=3,
        default_retry_delay=0,
    )
    def flaky_task(self: RunCellTask, hold_ms: float = 0) -> dict[str, Any]:
        with slot():
            time.sleep(hold_ms / 1000)
        return {"retries": self.request.retries}

    @app.task(
        shared=False,
        base=RunCellTask,
        bind=True,
        name="rc.child",
        concurrency={"limiter": "llm", "workload": "background"},
    )
    def child_task(self: RunCellTask, latency_ms: float = 5) -> dict[str, Any]:
        call_provider(latency_ms)
        return _run_info()

    @app.task(
        shared=False,
        base=RunCellTask,
        bind=True,
        name="rc.parent",
        concurrency={"limiter": "llm", "timeout_ms": 60_000},
    )
    def parent_task(
        self: RunCellTask, child_options: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        call_provider(5)
        child = child_task.apply_async((5,), **(child_options or {}))
        with allow_join_result():
            child_info = child.get(timeout=60)
        call_provider(5)  # the parent continues after its child
        return {"parent": _run_info(), "child": child_info}

    @app.task(
        shared=False,
        base=RunCellTask,
        bind=True,
        name="rc.slow_wait",
        concurrency={"limiter": "llm"},
    )
    def slow_wait_task(self: RunCellTask, latency_ms: float = 60_000) -> str:
        try:
            call_provider(latency_ms)
        except SoftTimeLimitExceeded:
            return "soft time limit"
        return "done"

    @app.task(
        shared=False,
        base=RunCellTask,
        bind=True,
        name="rc.defer_budget",
        concurrency={
            "limiter": "llm",
            "admission": "defer",
            "admission_wait_ms": 50,
            "timeout_ms": 4_000,
        },
    )
    def defer_budget_task(self: RunCellTask, latency_ms: float = 5) -> dict[str, Any]:
        return {**call_provider(latency_ms), **_run_info(), "retries": self.request.retries}

    @app.task(
        shared=False,
        base=RunCellTask,
        bind=True,
        name="rc.agent",
        concurrency={"limiter": "llm", "admission": "defer", "admission_wait_ms": 50},
    )
    def agent_task(self: RunCellTask, latency_ms: float = 50, tool_ms: float = 50) -> int:
        """Call the provider, run a tool (no slot held), call again: two slots a run."""
        call_provider(latency_ms)
        time.sleep(tool_ms / 1000)
        call_provider(latency_ms)
        return self.request.retries

    @app.task(
        shared=False,
        base=RunCellTask,
        bind=True,
        name="rc.spawn",
        concurrency={"limiter": "llm"},
    )
    def spawn_task(self: RunCellTask, children: int, latency_ms: float = 10) -> list[str]:
        """Send children (which inherit this run) and return without waiting for them."""
        return [wait_task.delay(latency_ms).id for _ in range(children)]

    @app.task(
        shared=False,
        base=RunCellTask,
        bind=True,
        name="rc.defer_echo",
        concurrency={"limiter": "llm", "admission": "defer", "admission_wait_ms": 50},
    )
    def defer_echo_task(self: RunCellTask, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Take a slot, then return the arguments as the task received them, and its
        retries (a deferral is not one)."""
        call_provider(5)
        return {"args": list(args), "kwargs": kwargs, "retries": self.request.retries}

    @app.task(shared=False, name="rc.local_counts")
    def local_counts() -> list[dict[str, Any]]:
        """This worker process's admission counts, written or not (a worker that cannot
        reach its database keeps them in memory)."""
        return [dataclasses.asdict(c) for c in state_for(app).counters.local()]

    @app.task(shared=False, name="rc.pool_report")
    def pool_report(server_port: int = 5432) -> dict[str, Any]:
        """How this worker process reaches the database: its backend's pool (settings
        and size), whether its grant listener is up, and the database connections the
        process holds, read together once two readings in a row agree."""
        registry = registry_for(app)
        backend = registry.backend
        assert isinstance(backend, PostgresBackend), backend
        limiter = registry.get("llm")
        assert isinstance(limiter, PostgresConcurrencyLimiter)
        pool = backend.pool
        listening = limiter.listening
        previous: tuple[int, set[int]] | None = None
        for _ in range(100):
            reading = (pool.get_stats()["pool_size"], database_ports(os.getpid(), server_port))
            if reading == previous:
                break
            previous = reading
            time.sleep(0.05)
        assert previous is not None
        return {
            "pid": os.getpid(),
            "max_size": pool.max_size,
            "timeout_s": pool.timeout,
            "pool_size": previous[0],
            "ports": sorted(previous[1]),
            "listening": listening,
        }

    @app.task(shared=False, name="rc.pool_exhausted")
    def pool_exhausted() -> dict[str, Any]:
        """Hold every connection of this process's pool, then record a run's first start:
        how long the store call waited for a connection, and how it failed."""
        backend = registry_for(app).backend
        assert isinstance(backend, PostgresBackend), backend
        pool = backend.pool
        with contextlib.ExitStack() as held:
            for _ in range(pool.max_size):
                held.enter_context(pool.connection())
            started = time.monotonic()
            try:
                backend.first_start(str(uuid.uuid4()), 60_000)
            except ConcurrencyLimiterError as exc:
                error = f"{type(exc).__name__}: {exc}"
            else:
                error = None
            waited_s = time.monotonic() - started
        return {"waited_s": waited_s, "error": error}


def _from_env() -> Celery | None:
    raw = os.environ.get(ENV)
    if not raw:
        return None
    settings = json.loads(raw)
    if settings.get("clock_skew_s"):
        skew_clock(float(settings["clock_skew_s"]))
    # Workers run with --loglevel=WARNING; a test that reads a logger's INFO lines in
    # the worker's log file raises that logger (e.g. {"runcell_celery": "INFO"}).
    for name, level in settings.get("log_levels", {}).items():
        logging.getLogger(name).setLevel(level)
    return create_app(settings)


app = _from_env()
