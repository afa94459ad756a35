"""Bad keys are refused where they enter, before any database call (issue 20, item 2).

Every entry is tried against PostgreSQL limiters whose database is made unreachable
first: a value that reached the database would fail as ``ConcurrencyLimiterError``
(as a good key does there), so a ``ConcurrencyConfigError`` naming the argument
shows the value was refused before. Beside them, a round-robin limiter on a reachable
database keeps granting, the longest key it allows included.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from celery import Celery
from psycopg import sql

from runcell_celery import ConcurrencyConfigError, ConcurrencyLimiterError, guard, slot
from runcell_celery.celery import RunCellTask
from runcell_celery.celery import headers as run_headers
from runcell_celery.celery.state import discard_state
from runcell_celery.context import run
from runcell_celery.keys import MAX_KEY_LENGTH
from runcell_celery.postgres import (
    PostgresConcurrencyLimiter,
    create_postgres_concurrency_limiter,
)
from tests.support.pg import ADMIN_DSN

BAD_KEYS: list[tuple[object, str]] = [
    ("k" * 3000, "at most 128 characters"),
    ("", "empty or blank"),
    ("a\x00b", "control characters"),
    (42, "must be a string"),
]
KEY_IDS = ["3000-chars", "empty", "nul", "not-a-string"]


def _allow_connections(dsn: str, allow: bool) -> None:
    name = psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]
    with psycopg.connect(ADMIN_DSN, autocommit=True) as conn:
        conn.execute(
            sql.SQL("ALTER DATABASE {} ALLOW_CONNECTIONS {}").format(
                sql.Identifier(name), sql.SQL("true" if allow else "false")
            )
        )
        if not allow:
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s",
                (name,),
            )


class _Request:
    id = "t1"
    root_id = "t1"
    parent_id = None

    def __init__(self, headers: dict[str, Any]) -> None:
        self.headers = headers


@pytest.fixture
def unreachable(
    fresh_dsn: str,
) -> Iterator[tuple[PostgresConcurrencyLimiter, PostgresConcurrencyLimiter, Celery]]:
    """A round-robin limiter, a keyed one and a Celery app on them, then the database
    refuses every connection."""
    options: dict[str, Any] = {"listen": False, "connect_timeout_ms": 1000}
    fair = create_postgres_concurrency_limiter(
        fresh_dsn, max_concurrent=1, name="fair", fairness="round_robin", **options
    )
    tenant = create_postgres_concurrency_limiter(
        fresh_dsn, max_concurrent=1, name="tenant", keyed=True, fairness="round_robin", **options
    )
    app = Celery("keys", broker="memory://", backend="cache+memory://", set_as_current=False)
    app.conf.runcell = {
        "DATABASE": fresh_dsn,
        "POSTGRES": options,
        "LIMITERS": {
            "fair": {"max_concurrent": 1, "fairness": "round_robin"},
            "tenant": {"max_concurrent": 1, "keyed": True, "fairness": "round_robin"},
        },
    }

    @app.task(
        base=RunCellTask,
        name="keys.task",
        concurrency={"limiter": ["fair", "tenant"], "key": "{tenant_id}"},
        shared=False,
    )
    def task(tenant_id: object) -> None:
        raise AssertionError("the body must not run")

    app.finalize(auto=True)
    _allow_connections(fresh_dsn, False)
    try:
        yield fair, tenant, app
    finally:
        _allow_connections(fresh_dsn, True)
        # The app's counters would otherwise go on retrying the dropped database, in
        # every later test of this process.
        discard_state(app)
        fair.close()
        tenant.close()


def _entries(
    fair: PostgresConcurrencyLimiter, tenant: PostgresConcurrencyLimiter, app: Celery
) -> dict[str, Callable[[object], object]]:
    def enter_slot(key: object) -> None:
        with slot(fair, key=key):  # type: ignore[arg-type]
            raise AssertionError("the body must not run")

    def enter_several(key: object) -> None:
        with slot(fair, tenant.key("acme"), key=key):  # type: ignore[arg-type]
            raise AssertionError("the body must not run")

    def enter_run(key: object) -> None:
        with run(limiter=fair, key=key), slot():  # type: ignore[arg-type]
            raise AssertionError("the body must not run")

    def call_guarded(key: object) -> None:
        guard(limiter=fair, key=key)(lambda: None)()  # type: ignore[arg-type]

    task = app.tasks["keys.task"]

    def send_task(key: object) -> None:
        task.apply_async((key,))

    def apply_eagerly(key: object) -> None:
        task.apply((key,))

    def deliver_key_header(key: object) -> None:
        run_headers.parse(
            _Request({run_headers.KEY: key}), task_name="keys.task", keyed=("tenant",)
        )

    def deliver_parent_header(key: object) -> None:
        parent = {"limiters": ["fair", "tenant"], "key": key}
        run_headers.parse(_Request({run_headers.PARENT: parent}), task_name="keys.task")

    return {
        "slot(key)": enter_slot,
        "slot(a, b, key)": enter_several,
        "run(key)": enter_run,
        "guard(key)": call_guarded,
        "tenant.key()": tenant.key,
        "task key option": send_task,
        "task key option, eagerly": apply_eagerly,
        "runcell_key header": deliver_key_header,
        "runcell_parent header": deliver_parent_header,
    }


ENTRIES = [
    "slot(key)",
    "slot(a, b, key)",
    "run(key)",
    "guard(key)",
    "tenant.key()",
    "task key option",
    "task key option, eagerly",
    "runcell_key header",
    "runcell_parent header",
]


#: Every entry with every bad key; a template ("{tenant_id}") renders any argument to a
#: string, so the task's key option meets no non-string (``str(42)`` is a good key).
CASES = [
    pytest.param(entry, key, rule, id=f"{entry}-{key_id}")
    for entry in ENTRIES
    for (key, rule), key_id in zip(BAD_KEYS, KEY_IDS, strict=True)
    if isinstance(key, str) or not entry.startswith("task key option")
]


@pytest.mark.parametrize(("entry", "key", "rule"), CASES)
def test_a_bad_key_is_refused_on_every_entry_before_any_database_call(
    unreachable: tuple[PostgresConcurrencyLimiter, PostgresConcurrencyLimiter, Celery],
    entry: str,
    key: object,
    rule: str,
) -> None:
    enter = _entries(*unreachable)[entry]
    with pytest.raises(ConcurrencyConfigError) as caught:
        enter(key)
    message = caught.value.message
    assert rule in message
    assert len(message) < 400  # the key's shape, not a 3,000-character dump


def test_a_good_key_does_reach_the_unreachable_database(
    unreachable: tuple[PostgresConcurrencyLimiter, PostgresConcurrencyLimiter, Celery],
) -> None:
    """The control: what passes the checks fails in the database, as the refused keys
    would have."""
    fair, tenant, _app = unreachable
    with pytest.raises(ConcurrencyLimiterError), slot(fair, key="acme"):
        raise AssertionError("the body must not run")
    with pytest.raises(ConcurrencyLimiterError), slot(tenant.key("acme")):
        raise AssertionError("the body must not run")


def test_a_round_robin_limiter_keeps_granting_beside_refused_keys(pg_dsn: str) -> None:
    fair = create_postgres_concurrency_limiter(
        pg_dsn, max_concurrent=1, name="fair-beside-bad-keys", fairness="round_robin"
    )
    longest = "\U0001f600" * MAX_KEY_LENGTH  # 512 bytes: fits the history's index
    granted: list[str] = []
    errors: list[BaseException] = []
    waiting = threading.Barrier(3)

    def wait_for_a_slot(key: str) -> None:
        try:
            waiting.wait(timeout=10)
            with run(limiter=fair, key=key, timeout_ms=30_000), slot():
                granted.append(key)
        except BaseException as exc:  # reported below
            errors.append(exc)

    with slot(fair, key="holder"):
        threads = [threading.Thread(target=wait_for_a_slot, args=(k,)) for k in ("b", longest)]
        for thread in threads:
            thread.start()
        waiting.wait(timeout=10)
        for bad, _rule in BAD_KEYS:
            with pytest.raises(ConcurrencyConfigError):
                slot(fair, key=bad)  # type: ignore[arg-type]
            with pytest.raises(ConcurrencyConfigError):
                run(limiter=fair, key=bad)  # type: ignore[arg-type]
    for thread in threads:
        thread.join(timeout=30)
    assert errors == []
    assert sorted(granted) == sorted(["b", longest])
    with slot(fair, key="after"):
        pass
    stats = fair.stats()
    assert (stats.active, stats.queued) == (0, 0)
