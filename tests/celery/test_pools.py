"""Every Celery pool the library supports, with real ``celery worker`` subprocesses: the
limit holds (the fake provider is the witness), deferred tasks park and are re-published,
and the lease keeper renews while a task's body blocks in I/O; under gevent a waiting
task costs a greenlet, not an OS thread; eventlet, and gevent in a process that is not
monkey-patched, are refused at start (:mod:`runcell_celery.celery.pools`).

One module-scoped set of workers per pool (prefork, threads, gevent, solo), shared by
that pool's tests; Redis broker, the session's PostgreSQL database.
"""

from __future__ import annotations

import contextlib
import copy
import json
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import psycopg
import pytest
import redis
from celery import Celery
from celery.concurrency.gevent import TaskPool as GeventPool
from celery.contrib.testing.worker import start_worker

from runcell_celery import slot
from runcell_celery.celery import registry_for
from runcell_celery.celery.conflicts import EX_CONFIG, WorkerRefused
from runcell_celery.celery.pools import CREDIT_CHECK_S, PromptCreditStep, refuse_unsupported_pool
from runcell_celery.celery.state import discard_state
from runcell_celery.testing import FakeProvider
from tests.conftest import wait_until
from tests.support.celery_app import REDIS_URL, database_ports
from tests.support.celery_fixtures import WorkerProcesses

from . import pools_app

#: The slots the tasks' workload may hold: ``llm`` has 3, one reserved for the
#: interactive workload (the test app's ``rc.*`` tasks declare both).
LIMIT = 2
#: Shorter than each half of ``pools.keep``'s body: held only if renewed meanwhile.
SHORT_TTL_MS = 1_500
POOL_MAX_SIZE = 3
LIMITERS = {
    "llm": {
        "max_concurrent": LIMIT + 1,
        "lease_ttl_ms": 10_000,
        "workloads": {"interactive": {"reserved": 1, "priority": 10}, "background": {}},
        "default_workload": "background",
    },
    "short-ttl": {"max_concurrent": 1, "lease_ttl_ms": SHORT_TTL_MS},
}
#: Workers per pool, and tasks each runs at once: more than the limit in all.
POOLS: dict[str, tuple[int, int]] = {
    "prefork": (1, 4),
    "threads": (1, 32),
    "gevent": (1, 40),
    "solo": (3, 1),
}
#: Tasks left waiting for a slot in one worker, to count what each costs.
WAITING = 24


class PoolWorkers:
    """One pool's workers, app, witness and Redis records, for a module's tests."""

    def __init__(self, name: str, pg_dsn: str, log_dir: Path, provider: FakeProvider) -> None:
        tag = uuid.uuid4().hex[:10]
        self.name = name
        self.provider = provider
        self.pg_dsn = pg_dsn
        self.settings: dict[str, Any] = {
            "queue": f"runcell-pools-{name}-{tag}",
            "events_key": f"runcell-pools-events-{tag}",
            "provider_url": provider.url,
            "runcell": {
                "DATABASE": pg_dsn,
                "LIMITERS": copy.deepcopy(LIMITERS),
                "POSTGRES": {
                    "poll_interval_ms": 50,
                    "on_conflict": "replace",
                    "pool_max_size": POOL_MAX_SIZE,
                },
            },
        }
        self.app = pools_app.create_app(self.settings)
        self.workers = WorkerProcesses(
            self.settings, log_dir, app="tests.celery.pools_app:app", env=pools_app.ENV
        )
        self.redis = redis.Redis.from_url(REDIS_URL)
        self.procs: list[Any] = []

    def start(self) -> None:
        count, concurrency = POOLS[self.name]
        self.procs = [
            self.workers.start(pool=self.name, concurrency=concurrency) for _ in range(count)
        ]
        for proc in self.procs:
            node = self.workers.nodename(proc)
            try:
                wait_until(
                    lambda node=node: self.app.control.ping(destination=[node], timeout=0.5),
                    f"the {self.name} worker answers",
                    60,
                    interval=0.1,
                )
            except AssertionError:
                print(self.workers.logs())
                raise

    def reset(self) -> None:
        self.provider.reset()
        self.redis.delete(self.settings["events_key"])

    def events(self, *types: str) -> list[dict[str, Any]]:
        raw = self.redis.lrange(self.settings["events_key"], 0, -1)
        return [e for e in map(json.loads, raw) if e["type"] in types]

    def replies(self, results: list[Any], timeout: float = 60) -> list[Any]:
        try:
            return [result.get(timeout=timeout) for result in results]
        except Exception:
            print(self.workers.logs())
            raise

    def stop(self) -> None:
        self.workers.stop_all()
        queue = self.settings["queue"]
        self.redis.delete(queue, f"{queue}.runcell", self.settings["events_key"])
        discard_state(self.app)


@pytest.fixture(scope="module", params=list(POOLS))
def pool(
    request: pytest.FixtureRequest, pg_dsn: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PoolWorkers]:
    name = request.param
    with FakeProvider(latency_ms=10) as provider:
        made = PoolWorkers(name, pg_dsn, tmp_path_factory.mktemp(f"pool-{name}"), provider)
        try:
            made.start()
            yield made
        finally:
            made.stop()


@pytest.fixture
def workers(pool: PoolWorkers) -> PoolWorkers:
    pool.reset()
    return pool


def _rows(dsn: str, query: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(query, params).fetchall()


def _queued(dsn: str, limiter: str, *, parked: bool) -> int:
    rows = _rows(
        dsn,
        "SELECT count(*) FROM runcell_queue WHERE limiter = %(limiter)s AND parked = %(parked)s",
        {"limiter": limiter, "parked": parked},
    )
    return int(rows[0][0])


@contextlib.contextmanager
def _all_slots_held(app: Celery) -> Iterator[None]:
    """Hold every slot of ``llm`` the tasks' workload may take, from this process, so
    the workers' tasks must wait."""
    limiter = registry_for(app).get("llm")
    with contextlib.ExitStack() as held:
        for _ in range(LIMIT):
            held.enter_context(slot(limiter))
        yield


def test_the_limit_holds_on_every_pool(workers: PoolWorkers) -> None:
    results = [workers.app.tasks["rc.wait"].delay(100) for _ in range(12)]
    assert len(workers.replies(results)) == 12
    witness = workers.provider.stats()
    assert witness.max_in_flight <= LIMIT, f"{witness.max_in_flight} in flight over {LIMIT}"
    assert witness.max_in_flight == LIMIT, "the limit was never reached; the test proves nothing"
    assert witness.completed == 12
    assert workers.events("lease-lost", "renewal-failed") == []


def test_deferred_tasks_park_and_are_re_published_on_every_pool(workers: PoolWorkers) -> None:
    app = workers.app
    with _all_slots_held(app):
        results = [app.tasks["rc.defer"].delay(50) for _ in range(4)]
        wait_until(
            lambda: _queued(workers.pg_dsn, "llm", parked=True) == 4,
            "the four tasks are parked",
            30,
            interval=0.05,
        )
        assert workers.provider.stats().total == 0, "a task ran while every slot was held"
    # Released: the grants re-publish the parked tasks, which run on their leases.
    replies = workers.replies(results)
    assert [reply["retries"] for reply in replies] == [0] * 4  # a deferral is no retry
    assert workers.provider.stats().completed == 4
    assert workers.provider.stats().max_in_flight <= LIMIT
    assert _queued(workers.pg_dsn, "llm", parked=True) == 0


class LeaseWatch:
    """Reads the ``short-ttl`` leases every 50 ms: each one's acquisition and latest
    renewal (database time)."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.leases: dict[str, tuple[float, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="test-lease-watch")

    def _run(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            while not self._stop.wait(0.05):
                rows = conn.execute(
                    "SELECT lease_id::text, extract(epoch FROM acquired_at)::float8, "
                    "extract(epoch FROM renewed_at)::float8 FROM runcell_lease "
                    "WHERE limiter = 'short-ttl'"
                ).fetchall()
                for lease_id, acquired, renewed in rows:
                    self.leases[lease_id] = (acquired, renewed)

    def __enter__(self) -> LeaseWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def test_the_keeper_renews_while_the_body_blocks_in_io_on_every_pool(
    workers: PoolWorkers,
) -> None:
    keep = workers.app.tasks["pools.keep"]
    io_ms = sleep_ms = 2 * SHORT_TTL_MS * 2 // 3  # each longer than the TTL
    with LeaseWatch(workers.pg_dsn) as watch:
        long = keep.delay(io_ms, sleep_ms)
        wait_until(lambda: watch.leases, "the long task holds its lease", 30, interval=0.05)
        short = keep.delay(300, 0)  # waits: the limit is one (held long enough to be seen)
        first, second = workers.replies([long, short])
    acquired, renewed = watch.leases[first["lease_id"]]
    assert renewed - acquired >= 2 * SHORT_TTL_MS / 1000, (
        f"renewed {renewed - acquired:.2f}s after it was acquired, over a "
        f"{(io_ms + sleep_ms) / 1000}s hold with a {SHORT_TTL_MS / 1000}s TTL"
    )
    # Never lost: the second task got the slot only after the first let it go.
    assert watch.leases[second["lease_id"]][0] >= renewed
    assert workers.provider.stats().max_in_flight == 1
    assert workers.events("lease-lost", "renewal-failed") == []


def _worker_threads_and_connections(proc: Any, server_port: int) -> tuple[int, int]:
    process = psutil.Process(proc.pid)
    return process.num_threads(), len(database_ports(proc.pid, server_port))


@pytest.mark.parametrize("pool", ["gevent", "threads"], indirect=True)
def test_a_waiting_task_costs_a_greenlet_on_gevent_and_a_thread_on_threads(
    workers: PoolWorkers,
) -> None:
    app = workers.app
    port = int(psycopg.conninfo.conninfo_to_dict(workers.pg_dsn).get("port") or 5432)
    with _all_slots_held(app):
        results = [app.tasks["rc.wait"].delay(10) for _ in range(WAITING)]
        wait_until(
            lambda: _queued(workers.pg_dsn, "llm", parked=False) == WAITING,
            f"{WAITING} tasks wait for a slot",
            30,
            interval=0.05,
        )
        threads, connections = _worker_threads_and_connections(workers.procs[0], port)
    assert len(workers.replies(results)) == WAITING
    # Waiting holds no connection: the pool's and the listener's at most.
    assert connections <= POOL_MAX_SIZE + 1, connections
    if workers.name == "gevent":
        assert threads < WAITING / 2, f"{threads} OS threads for {WAITING} waiting tasks"
    else:  # the measure can tell: a threads pool spends a thread per waiting task
        assert threads >= WAITING, threads


@pytest.mark.parametrize("pool", ["gevent", "threads"], indirect=True)
def test_a_gevent_worker_warns_once_of_the_tasks_that_defer(workers: PoolWorkers) -> None:
    log = workers.workers.logs()
    said = 'declare "admission": "defer" on a gevent worker'
    assert log.count(said) == (1 if workers.name == "gevent" else 0), log
    if workers.name == "gevent":
        assert "'rc.defer'" in log, log


# -- refused pools --------------------------------------------------------------------------


def _settings(pg_dsn: str) -> dict[str, Any]:
    tag = uuid.uuid4().hex[:10]
    return {
        "queue": f"runcell-pools-refused-{tag}",
        "runcell": {
            "DATABASE": pg_dsn,
            "LIMITERS": copy.deepcopy(LIMITERS),
            "POSTGRES": {"on_conflict": "replace"},
        },
    }


def test_an_eventlet_worker_refuses_to_start_naming_the_pool(pg_dsn: str, tmp_path: Path) -> None:
    group = WorkerProcesses(_settings(pg_dsn), tmp_path)
    try:
        proc = group.start(pool="eventlet", concurrency=4)
        status = proc.wait(60)
    finally:
        group.stop_all()
    log = group.logs()
    assert status == EX_CONFIG, log
    assert log.count("refuses to start: the eventlet pool (-P eventlet) is not supported") == 1
    assert "-P gevent" in log, log
    assert "Traceback" not in log, log


def test_a_gevent_worker_in_an_unpatched_process_refuses_to_start(make_app, pg_dsn: str) -> None:
    app = make_app(limits=LIMITERS["llm"])
    with (
        pytest.raises(WorkerRefused) as refused,
        start_worker(app, pool="gevent", perform_ping_check=False, loglevel="WARNING"),
    ):
        pass
    assert refused.value.code == EX_CONFIG
    message = refused.value.message
    assert "the gevent pool runs in a process that gevent has not monkey-patched" in message
    assert "threading, socket, select, time not patched" in message
    assert "celery worker -P gevent" in message


def test_a_patched_gevent_worker_whose_psycopg_waits_in_c_refuses_to_start(
    make_app, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gevent import monkey
    from psycopg import waiting

    # This process imported psycopg unpatched: it waits in C, as a worker would that
    # imported psycopg before gevent patched it.
    assert waiting.wait is waiting.wait_c
    monkeypatch.setattr(monkey, "is_module_patched", lambda name: True)
    worker = type("Worker", (), {"pool_cls": GeventPool, "app": make_app()})()
    with pytest.raises(WorkerRefused) as refused:
        refuse_unsupported_pool(worker)
    assert "psycopg waits for the database in C" in refused.value.message
    assert "imported before gevent monkey-patched the process" in refused.value.message


@pytest.mark.parametrize("pool_cls", ["celery.concurrency.thread:TaskPool", "prefork", "solo"])
def test_prefork_threads_and_solo_start_as_they_are(make_app, pool_cls: str) -> None:
    from celery.concurrency import get_implementation

    worker = type("Worker", (), {"pool_cls": get_implementation(pool_cls), "app": make_app()})()
    refuse_unsupported_pool(worker)  # no refusal


# -- prompt credit under the green pools' blocking consumer loop ----------------------------


class _Qos:
    def __init__(self) -> None:
        self.full = True

    def can_consume(self) -> bool:
        return not self.full


class _Connection:
    def __init__(self) -> None:
        self.timeouts: list[float | None] = []

    def drain_events(self, timeout: float | None = None) -> None:
        self.timeouts.append(timeout)


def _consumer(hub: object | None) -> Any:
    channel = type("Channel", (), {"qos": _Qos()})()
    task_consumer = type("TaskConsumer", (), {"channel": channel})()
    return type(
        "Consumer", (), {"hub": hub, "connection": _Connection(), "task_consumer": task_consumer}
    )()


def test_a_green_consumer_waits_briefly_for_the_broker_while_its_prefetch_window_is_full() -> None:
    consumer = _consumer(hub=None)
    PromptCreditStep(consumer).start(consumer)
    consumer.connection.drain_events(timeout=2.0)  # full: look again soon
    consumer.task_consumer.channel.qos.full = False
    consumer.connection.drain_events(timeout=2.0)  # room: the broker wakes it
    assert consumer.connection.timeouts == [CREDIT_CHECK_S, 2.0]


def test_a_consumer_with_an_event_loop_is_left_alone() -> None:
    consumer = _consumer(hub=object())
    PromptCreditStep(consumer).start(consumer)
    consumer.connection.drain_events(timeout=2.0)
    assert consumer.connection.timeouts == [2.0]
