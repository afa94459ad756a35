"""``celery -A proj runcell status|sync-limiters|release|purge`` as an operator runs it:
subprocesses of the ``celery`` command against a real worker's limiters.

The Celery-only app's commands run with Django impossible to import (``sys.modules``
says so), so they cannot lean on it; a Django project's app, configured only by
``settings.RUNCELL``, is read through runcell_django, its event tables made by ``migrate``.
"""

from __future__ import annotations

import copy
import getpass
import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis
from celery import Celery

from runcell_celery import ConcurrencyLeaseLostError, run, slot
from runcell_celery.postgres import create_postgres_concurrency_limiter, ensure_schema
from tests.conftest import wait_until
from tests.support.celery_app import ENV, REDIS_URL
from tests.support.celery_fixtures import ROOT, WorkerProcesses
from tests.support.django_project import DjangoProject
from tests.support.pg import create_database, drop_database

#: ``python -m celery``, with Django unimportable.
WITHOUT_DJANGO = (
    "import sys; sys.modules['django'] = None; from celery.__main__ import main; main()"
)

#: Long enough for every command to run while the slots are held, on a busy machine:
#: the test ends by killing the worker (its database is the test's own).
HOLD_MS = 60_000


@pytest.fixture
def database() -> Iterator[str]:
    """A database of this test's own: the counts it reads are its tasks' alone."""
    dsn = create_database("runcell_cmd")
    with psycopg.connect(dsn, autocommit=True) as conn:
        ensure_schema(conn)
    try:
        yield dsn
    finally:
        drop_database(dsn)


def runcell(settings: dict[str, Any], *args: str) -> subprocess.CompletedProcess[str]:
    """``celery -A tests.support.celery_app:app runcell ARGS``, the app configured by
    ``settings`` (as its worker is), without Django."""
    env = {**os.environ, ENV: json.dumps(settings), "PYTHONPATH": str(ROOT)}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    argv = [sys.executable, "-c", WITHOUT_DJANGO, "-A", "tests.support.celery_app:app"]
    return subprocess.run(
        [*argv, "runcell", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )


def succeeded(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, f"{done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def failed(done: subprocess.CompletedProcess[str], status: int = 1) -> str:
    """The one-line error of a command that failed, without a traceback."""
    assert done.returncode == status, f"{done.returncode}\n{done.stdout}\n{done.stderr}"
    assert "Traceback" not in done.stderr
    return done.stderr


def line_of(table: str, first: str) -> list[str]:
    (line,) = [line.split() for line in table.splitlines() if line.split()[:1] == [first]]
    return line


def counts(dsn: str) -> tuple[int, int, int]:
    """Leases held, requests waiting, requests parked on ``llm`` (read apart from the
    commands)."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT (SELECT count(*) FROM runcell_lease WHERE expires_at > now()),"
            " count(*) FILTER (WHERE NOT parked), count(*) FILTER (WHERE parked)"
            " FROM runcell_queue WHERE granted_lease_id IS NULL AND expired_at IS NULL"
        ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1]), int(row[2])


def leases_of(dsn: str, run_id: str) -> list[str]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT lease_id::text FROM runcell_lease WHERE run_id = %s AND expires_at > now()",
            (run_id,),
        ).fetchall()
    return [lease_id for (lease_id,) in rows]


def test_status_release_and_sync_against_a_worker_holding_slots_without_django(
    make_app: Callable[..., Celery],
    worker_processes: Callable[..., WorkerProcesses],
    celery_settings: dict[str, Any],
    worker_events: Callable[[], list[dict[str, Any]]],
    database: str,
) -> None:
    settings = copy.deepcopy(celery_settings)
    settings["runcell"]["DATABASE"] = database
    app = make_app(**settings)
    workers = worker_processes(**settings)
    workers.start(pool="threads", concurrency=8, answering=app)
    wait, defer = app.tasks["rc.wait"], app.tasks["rc.defer"]

    # 3 slots: background holds the 2 it may (1 is reserved), interactive the third;
    # then one more background task waits in its worker and two park.
    holders = [wait.delay(HOLD_MS), wait.delay(HOLD_MS)]
    holders.append(wait.apply_async((HOLD_MS,), concurrency={"workload": "interactive"}))
    wait_until(lambda: counts(database) == (3, 0, 0), "3 slots held", 30, interval=0.05)
    waiter = wait.delay(100)
    wait_until(lambda: counts(database) == (3, 1, 0), "a task waits", 30, interval=0.05)
    parked = [defer.delay(100), defer.delay(100)]
    wait_until(lambda: counts(database) == (3, 1, 2), "two tasks park", 30, interval=0.05)

    [llm] = json.loads(succeeded(runcell(settings, "status", "--json")))["limiters"]
    assert (llm["name"], llm["held"], llm["limit"], llm["queued"], llm["parked"]) == (
        "llm",
        3,
        3,
        3,
        2,
    )
    assert llm["oldest_wait_ms"] > 0
    workloads = {w["name"]: w for w in llm["workloads"]}
    background, interactive = workloads["background"], workloads["interactive"]
    assert (background["held"], background["effective_limit"], background["queued"]) == (2, 2, 3)
    assert background["parked"] == 2
    assert (interactive["held"], interactive["reserved"], interactive["queued"]) == (1, 1, 0)

    table = succeeded(runcell(settings, "status"))
    header = ["limiter", "workload", "held", "limit", "queued", "parked"]
    assert table.splitlines()[0].split()[:6] == header
    assert line_of(table, "llm")[:6] == ["llm", "(all)", "3", "3", "3", "2"]
    assert line_of(table, "background") == ["background", "2", "3", "3", "2"]
    assert line_of(table, "interactive") == ["interactive", "1", "3", "(1", "reserved)", "0", "0"]

    # Force release the slot of one background task: the waiting task gets it.
    released_task = holders[0].id
    [lease_id] = leases_of(database, released_task)
    release = ["release", "--limiter", "llm", "--task", released_task, "--actor", "alice"]
    out = succeeded(runcell(settings, *release))
    assert out.startswith(f"Released lease {lease_id} of llm/background (task {released_task},")
    assert out.rstrip().endswith("as alice.")
    assert leases_of(database, released_task) == []
    # The waiting task got the slot at once: it is done while the others still hold theirs.
    assert waiter.get(timeout=30)["workload"] == "background"
    assert not holders[1].ready()
    with psycopg.connect(database) as conn:
        noted = conn.execute(
            "SELECT result->>'force_released_by' FROM runcell_operation WHERE op_id = %s",
            (lease_id,),
        ).fetchone()
    assert noted == ("alice",)
    wait_until(
        lambda: any(
            e["type"] == "lease-lost" and e.get("run_id") == released_task for e in worker_events()
        ),
        "the holder learns it lost its slot",
        30,
    )
    [lost] = [e for e in worker_events() if e["type"] == "lease-lost"]
    assert lost["reason"] == "force-released by alice"

    # Nothing is released unless everything named holds a slot of the limiter.
    [other_lease] = leases_of(database, holders[1].id)
    assert "no limiter named 'lm' is stored; did you mean 'llm'?" in failed(
        runcell(settings, "release", "--limiter", "lm", other_lease)
    )
    refused = failed(runcell(settings, "release", "-l", "llm", other_lease, "--task", "nope"))
    assert "run 'nope' holds no slot of 'llm'; nothing was released" in refused
    with psycopg.connect(database) as conn:
        row = conn.execute("SELECT 1 FROM runcell_operation WHERE op_id = %s", (other_lease,))
        assert row.fetchone() is None  # no operator took it back (its task may be done)

    # The workers' limits are stored; other limits are refused unless --replace.
    assert succeeded(runcell(settings, "sync-limiters")) == "llm: unchanged\n"
    other = copy.deepcopy(settings)
    other["runcell"]["LIMITERS"]["llm"]["max_concurrent"] = 5
    other["runcell"]["POSTGRES"]["on_conflict"] = "error"
    conflict = runcell(other, "sync-limiters")
    assert conflict.stdout.startswith("llm: differs (max_concurrent, ")
    assert "run again with --replace" in failed(conflict)
    assert "max_concurrent (stored 3, given 5)" in conflict.stderr

    # The released slot went on down the line: the waiter's, then the parked tasks'.
    try:
        replies = [r.get(timeout=60) for r in parked]
    except Exception:
        print(workers.logs())
        raise
    assert [reply["workload"] for reply in replies] == ["background", "background"]
    assert not any(holder.ready() for holder in holders)
    workers.kill(workers.procs[0])  # the holders' calls would run a minute yet
    queue = settings["queue"]
    redis.Redis.from_url(REDIS_URL).delete(f"{queue}-unacked", f"{queue}-unacked-index")


def test_bad_values_are_named_with_a_non_zero_exit_and_no_traceback(
    celery_settings: dict[str, Any],
) -> None:
    settings = copy.deepcopy(celery_settings)
    assert "'7x' is not a duration" in failed(runcell(settings, "purge", "--older-than", "7x"), 2)
    assert "'abc' is not a lease id" in failed(runcell(settings, "release", "-l", "llm", "abc"))
    settings["runcell"]["LIMITERS"]["llm"]["max_concurent"] = 3
    typo = failed(runcell(settings, "status"))
    assert (
        "[\"max_concurent\"] = 3 is invalid: unknown option; did you mean 'max_concurrent'?" in typo
    )


CELERY_MODULE = """
import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "mysite.settings")
app = Celery("mysite")
app.config_from_object("django.conf:settings", namespace="CELERY")
"""


def postgres_default(dsn: str) -> str:
    params = psycopg.conninfo.conninfo_to_dict(dsn)
    database = {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": params["dbname"],
        "USER": params.get("user", ""),
        "HOST": params.get("host", ""),
        "PORT": str(params.get("port", "")),
    }
    return f"DATABASES = {{'default': {database!r}}}"


def test_a_django_projects_app_is_read_through_settings_runcell_and_its_events_purged(
    tmp_path: Path, database: str
) -> None:
    project = DjangoProject(tmp_path / "site")
    project.add_settings(
        postgres_default(database)
        + "\nINSTALLED_APPS += ['runcell_django']\n"
        + "RUNCELL = {'DATABASE': 'default', 'LIMITERS': {'llm': {'max_concurrent': 2}},"
        + " 'EVENTS': {'ENABLED': False}}\n"
    )
    project.write("mysite/celery.py", CELERY_MODULE)
    migrated = project.manage("migrate")
    assert migrated.returncode == 0, migrated.stderr

    def celery(*args: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "celery", "-A", "mysite.celery:app", "runcell", *args]
        env = project.environment()
        return subprocess.run(
            argv, cwd=project.root, env=env, capture_output=True, text=True, timeout=60
        )

    with psycopg.connect(database, autocommit=True) as conn:
        for days, wait_ms in ((10, None), (30, None), (1, None)):
            conn.execute(
                "INSERT INTO runcell_event (type, occurred_at, limiter, wait_ms)"
                " VALUES ('released', now() - %s * interval '1 day', 'llm', %s)",
                (days, wait_ms),
            )
        for wait_ms in range(1, 101):  # waits of 1..100 ms granted a minute ago
            conn.execute(
                "INSERT INTO runcell_event (type, occurred_at, limiter, wait_ms)"
                " VALUES ('acquired', now() - interval '1 minute', 'llm', %s)",
                (wait_ms,),
            )
        conn.execute(
            "INSERT INTO runcell_occupancy (limiter, workload, sampled_at, active, queued)"
            " VALUES ('llm', 'default', now() - interval '9 days', 1, 0)"
        )

    limiter = create_postgres_concurrency_limiter(database, name="llm", max_concurrent=2)
    outcome: list[BaseException] = []

    def hold() -> None:
        try:
            with run(limiter=limiter, run_id="stuck-task"), slot() as held:
                wait_until(lambda: held.aborted, "the holder learns it lost its slot", 30)
        except BaseException as exc:
            outcome.append(exc)

    holder = threading.Thread(target=hold, name="stuck-task")
    holder.start()
    try:
        wait_until(lambda: leases_of(database, "stuck-task"), "the slot is held", 30)
        [llm] = json.loads(succeeded(celery("status", "--json")))["limiters"]
        assert (llm["held"], llm["limit"]) == (1, 2)
        assert llm["p95_wait_ms"] == pytest.approx(95.05)

        out = succeeded(celery("release", "--limiter", "llm", "--task", "stuck-task"))
        actor = f"{getpass.getuser()}@{socket.gethostname()}"
        assert out.rstrip().endswith(f"as {actor}.")
        holder.join(30)
    finally:
        limiter.close()
    assert isinstance(outcome[0], ConcurrencyLeaseLostError)
    with psycopg.connect(database) as conn:
        recorded = conn.execute(
            "SELECT actor, run_id, limiter FROM runcell_event WHERE type = 'force-released'"
        ).fetchall()
    assert recorded == [(actor, "stuck-task", "llm")]

    purged = succeeded(celery("purge", "--older-than", "7d"))
    assert purged == "Deleted 2 events and 1 occupancy sample older than 7 days.\n"
    with psycopg.connect(database) as conn:
        left = conn.execute("SELECT type, count(*) FROM runcell_event GROUP BY type").fetchall()
    assert dict(left) == {"released": 1, "acquired": 100, "force-released": 1}
