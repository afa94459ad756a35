"""Fixtures for the Celery tests: apps on a queue of their own, real workers, events.

* ``celery_settings`` — settings for :func:`tests.support.celery_app.create_app`: a
  unique queue and events key per test, the session's PostgreSQL database, a fake
  provider started for the test.
* ``make_app`` — builds an app from those settings (with overrides).
* Celery's own fixtures (``celery.contrib.pytest``) set up for those settings: its
  ``celery_app`` is configured by ``celery_config`` (and a test's
  ``@pytest.mark.celery(...)``) and gets the test tasks; its ``celery_worker`` runs
  them in this process on a threads pool (``celery_worker_pool``,
  ``celery_worker_parameters``).
* ``worker_processes`` — ``celery worker`` subprocesses (prefork or solo), stopped by PID.
* :class:`WorkerScenario` — for tests on an app module of their own
  (``tests/celery/*_app.py``): the app, its worker subprocesses and Redis records.
* ``worker_events`` — the concurrency events the workers pushed to Redis.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, Self

import pytest
import redis
from celery import Celery
from celery.result import AsyncResult
from celery.utils.nodenames import host_format

from runcell_celery import remove_event_listener
from runcell_celery.celery import admission_counts
from runcell_celery.celery.state import discard_state, state_for
from runcell_celery.testing import FakeProvider
from tests.conftest import wait_until

from .celery_app import ENV, EVENT_RECORDERS, REDIS_URL, celery_conf, create_app, register_tasks

ROOT = Path(__file__).resolve().parents[2]

LIMITS = {
    "max_concurrent": 3,
    "lease_ttl_ms": 5_000,
    "workloads": {
        "interactive": {"reserved": 1, "priority": 10},
        "background": {},
    },
    "default_workload": "background",
}


@pytest.fixture
def provider() -> Iterator[FakeProvider]:
    with FakeProvider(latency_ms=10) as fake:
        yield fake


@pytest.fixture
def celery_settings(pg_dsn: str, provider: FakeProvider) -> Iterator[dict[str, Any]]:
    tag = uuid.uuid4().hex[:10]
    settings = {
        "queue": f"runcell-test-{tag}",
        "events_key": f"runcell-test-events-{tag}",
        "provider_url": provider.url,
        "runcell": {
            "DATABASE": pg_dsn,
            "LIMITERS": {"llm": copy.deepcopy(LIMITS)},
            # Tests run one after another with different limits under one name.
            "POSTGRES": {"poll_interval_ms": 50, "on_conflict": "replace"},
        },
    }
    yield settings
    client = redis.Redis.from_url(REDIS_URL)
    # The queue, and the granted queue its workers also consume (runcell_celery.celery.message).
    client.delete(settings["events_key"], settings["queue"], f"{settings['queue']}.runcell")


@pytest.fixture
def make_app(celery_settings: dict[str, Any]) -> Iterator[Callable[..., Celery]]:
    """``make_app(limits=..., **settings)``: an app on this test's queue and database."""
    apps: list[Celery] = []

    def make(limits: dict[str, Any] | None = None, **overrides: Any) -> Celery:
        settings = {**copy.deepcopy(celery_settings), **overrides}
        if limits is not None:
            settings["runcell"]["LIMITERS"] = {"llm": limits}
        app = create_app(settings)
        apps.append(app)
        return app

    yield make
    for app in apps:
        state = state_for(app)
        remove_event_listener(state.counters.on_event)
        listener = EVENT_RECORDERS.pop(app, None)
        if listener is not None:
            remove_event_listener(listener)
        state.counters.close()  # a last write while the test's database still exists


#: How long the in-process worker's Redis consumer blocks on its queue (kombu's
#: ``polling_interval``, its ``BRPOP`` timeout): the worker notices it should stop
#: within that, not the default 1 s.
INPROCESS_POLL_S = 0.1


@pytest.fixture
def celery_config(celery_settings: dict[str, Any]) -> dict[str, Any]:
    """Celery's ``celery_app`` configured as the test app (:func:`celery_conf`): Redis
    broker and results, this test's queue, database and limits.

    A test changes any key with ``@pytest.mark.celery(key=value)`` (Celery's own
    mark); ``runcell=`` there replaces only the keys it names of the test's runcell
    settings (see ``celery_app``).
    """
    conf = celery_conf(celery_settings)
    conf["broker_transport_options"] = {
        **conf["broker_transport_options"],
        "polling_interval": INPROCESS_POLL_S,
    }
    return conf


@pytest.fixture
def celery_app(
    celery_app: Celery,
    celery_config: dict[str, Any],
    celery_settings: dict[str, Any],
    request: pytest.FixtureRequest,
) -> Iterator[Celery]:
    """Celery's ``celery_app`` with the test tasks (``rc.*``), their events recorded.

    A ``runcell`` dict in the test's ``@pytest.mark.celery(...)`` is laid over the
    test's runcell settings (``LIMITERS`` of its own, say), so the test database and
    its ``POSTGRES`` options stay: Celery's mark would replace the whole dict.
    Afterwards the app's integration state (counter listener, pool, listener) and
    event recorder are dropped.
    """
    mark = request.node.get_closest_marker("celery")
    overrides = mark.kwargs.get("runcell", {}) if mark is not None else {}
    celery_app.conf.runcell = {**celery_config["runcell"], **overrides}
    register_tasks(celery_app, celery_settings)
    yield celery_app
    _forget(celery_app)


@pytest.fixture(scope="session")
def celery_worker_pool() -> str:
    """Threads: the tasks run at once, as in a worker process (Celery's default is solo)."""
    return "threads"


@pytest.fixture(scope="session")
def celery_worker_parameters() -> dict[str, Any]:
    """Four threads, more than the tests' limits (so the limit is what holds tasks
    back), no ping task (the worker is ready once ``celery_worker`` yields), warnings
    logged."""
    return {"concurrency": 4, "perform_ping_check": False, "loglevel": "WARNING"}


def _forget(app: Celery) -> None:
    """Drop what the integration and the test tasks keep for ``app`` in this process."""
    listener = EVENT_RECORDERS.pop(app, None)
    if listener is not None:
        remove_event_listener(listener)
    discard_state(app)


class WorkerProcesses:
    """``celery worker`` subprocesses; each in its own session, killed by PID.

    ``app``: the worker's ``-A`` app (``module:attribute``), built from ``settings`` as
    JSON in the environment variable ``env``.
    """

    def __init__(
        self,
        settings: dict[str, Any],
        log_dir: Path,
        *,
        app: str = "tests.support.celery_app:app",
        env: str = ENV,
    ) -> None:
        self.settings = settings
        self.log_dir = log_dir
        self.app = app
        self.env = env
        self.procs: list[subprocess.Popen[bytes]] = []
        self.nodenames: dict[int, str] = {}

    def start(
        self,
        *,
        concurrency: int = 4,
        name: str | None = None,
        pool: str = "prefork",
        answering: Celery | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start a worker; with ``answering``, return once it answers that app's ping."""
        name = name or f"w{len(self.procs) + 1}-{uuid.uuid4().hex[:6]}"
        env = {**os.environ, self.env: json.dumps(self.settings), "PYTHONPATH": str(ROOT)}
        log = open(self.log_dir / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                self.app,
                "worker",
                f"--pool={pool}",
                f"--concurrency={concurrency}",
                "-Q",
                self.settings["queue"],
                f"--hostname={name}@%h",
                "--loglevel=WARNING",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
            ],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        proc.log = log  # type: ignore[attr-defined]
        self.procs.append(proc)
        self.nodenames[proc.pid] = host_format(f"{name}@%h")
        if answering is not None:
            wait_until(
                lambda: answering.control.ping(destination=[self.nodename(proc)], timeout=0.5),
                "the worker answers",
                60,
                interval=0.1,
            )
        return proc

    def nodename(self, proc: subprocess.Popen[bytes]) -> str:
        """The worker's node name (``<name>@<host>``), as control commands address it."""
        return self.nodenames[proc.pid]

    def kill(self, proc: subprocess.Popen[bytes]) -> None:
        """SIGKILL the worker and its pool processes (its whole process group)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGCONT)  # a test may have paused a child
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # stray pool children, if any
            proc.log.close()  # type: ignore[attr-defined]

    def logs(self) -> str:
        return "\n".join(
            f"--- {path.name}\n{path.read_text(errors='replace')[-4000:]}"
            for path in sorted(self.log_dir.glob("*.log"))
        )


class WorkerScenario:
    """One test's app, its worker subprocesses (stopped by PID) and its Redis records.

    ``app_module`` (e.g. :mod:`tests.celery.keyed_app`) has ``create_app(settings)``,
    which builds the test's app lazily, and ``app``, the workers' app, built from the
    settings as JSON in the environment variable ``ENV``. ``settings`` start with
    ``queue`` (``runcell-<name>-<tag>``), ``database`` and ``records_key``
    (``runcell-<name>-records-<tag>``), ``tag`` unique to the test; a subclass adds its
    own before the app is built. :meth:`stop` deletes the queue, its granted queue and
    every ``<records_key>:*`` key. Use it as a context manager.
    """

    def __init__(self, name: str, pg_dsn: str, log_dir: Path, app_module: ModuleType) -> None:
        self.tag = tag = uuid.uuid4().hex[:10]
        settings: dict[str, Any] = {
            "queue": f"runcell-{name}-{tag}",
            "database": pg_dsn,
            "records_key": f"runcell-{name}-records-{tag}",
        }
        self.settings = settings
        self.redis = redis.Redis.from_url(REDIS_URL)
        self.workers = WorkerProcesses(
            settings, log_dir, app=f"{app_module.__name__}:app", env=app_module.ENV
        )
        self._create_app: Callable[[dict[str, Any]], Celery] = app_module.create_app
        self._app: Celery | None = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def app(self) -> Celery:
        if self._app is None:
            self._app = self._create_app(self.settings)
        return self._app

    def start_worker(self, concurrency: int) -> None:
        """Start a prefork worker; return once it answers."""
        self.workers.start(concurrency=concurrency, answering=self.app)

    def highest(self, key: str | None = None) -> int:
        """The most tasks seen in flight at once (for ``key``, or in total), as
        :func:`tests.support.witness_apps.counted_in_flight` records them."""
        suffix = f":{key}" if key is not None else ""
        raw = self.redis.get(f"{self.settings['records_key']}:max{suffix}")
        return int(raw) if raw is not None else 0

    def replies(self, results: list[AsyncResult[Any]], timeout: float = 120) -> list[Any]:
        """Every result's value; the workers' logs are printed if one fails."""
        try:
            return [result.get(timeout=timeout) for result in results]
        except Exception:
            print(self.logs())
            raise

    def admission_counts(self, task_name: str) -> dict[str, dict[str, int]]:
        """``task_name``'s admission counts, by limiter label."""
        return {
            count.limiter: {
                "deliveries": count.deliveries,
                "deferrals": count.deferrals,
                "provider_attempts": count.provider_attempts,
                "provider_failures": count.provider_failures,
                "concurrency_failures": count.concurrency_failures,
            }
            for count in admission_counts(self.app)
            if count.task_name == task_name
        }

    def logs(self) -> str:
        return self.workers.logs()

    def stop(self) -> None:
        self.workers.stop_all()
        keys = list(self.redis.scan_iter(f"{self.settings['records_key']}:*"))
        queue = self.settings["queue"]
        self.redis.delete(queue, f"{queue}.runcell", *keys)


@pytest.fixture
def worker_processes(
    celery_settings: dict[str, Any], tmp_path: Path
) -> Iterator[Callable[..., WorkerProcesses]]:
    """``worker_processes(**settings)``: a set of worker subprocesses on this test's queue."""
    groups: list[WorkerProcesses] = []

    def make(**overrides: Any) -> WorkerProcesses:
        settings = {**copy.deepcopy(celery_settings), **overrides}
        group = WorkerProcesses(settings, tmp_path)
        groups.append(group)
        return group

    yield make
    for group in groups:
        group.stop_all()


@pytest.fixture
def worker_events(celery_settings: dict[str, Any]) -> Callable[[], list[dict[str, Any]]]:
    """Read every event the workers (and this process's apps) pushed so far."""
    client = redis.Redis.from_url(REDIS_URL)

    def read() -> list[dict[str, Any]]:
        return [json.loads(raw) for raw in client.lrange(celery_settings["events_key"], 0, -1)]

    return read
