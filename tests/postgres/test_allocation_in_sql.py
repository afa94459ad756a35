"""The database's allocation agrees with the one allocation function.

``runcell_allocate`` carries out :func:`runcell_celery.allocation.allocate` in the
database, so that a release grants the next waiters in one round trip. Here both are
given the same limits, slots held and waiters (random, through hypothesis) and must
grant the same requests in the same order.
"""

from __future__ import annotations

import json
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runcell_celery import LimiterConfig, allocate
from runcell_celery.allocation import allocate_members
from runcell_celery.postgres import postgres_concurrency_schema_sql
from tests.support.pg import create_database, drop_database


@dataclass(frozen=True)
class Waiter:
    workload: str
    in_progress: bool


@st.composite
def states(draw: st.DrawFn) -> tuple[LimiterConfig, dict[str, int], list[Waiter]]:
    """Valid limits, a valid number of slots held per workload, and waiters in order."""
    max_concurrent = draw(st.integers(1, 6))
    names = draw(st.lists(st.sampled_from(["a", "b", "c"]), min_size=1, max_size=3, unique=True))
    workloads = {}
    unreserved = max_concurrent
    for name in names:
        ceiling = draw(st.one_of(st.none(), st.integers(1, max_concurrent)))
        reserved = draw(st.integers(0, min(unreserved, ceiling or max_concurrent)))
        unreserved -= reserved
        workloads[name] = {
            "max_concurrent": ceiling,
            "reserved": reserved,
            "priority": draw(st.integers(0, 2)),
        }
    config = LimiterConfig.from_mapping(
        {"max_concurrent": max_concurrent, "workloads": workloads, "default_workload": names[0]}
    )
    active = {name: draw(st.integers(0, config.ceiling(name))) for name in names}
    while sum(active.values()) > max_concurrent:
        name = draw(st.sampled_from(names))
        active[name] = max(0, active[name] - 1)
    waiting = draw(st.lists(st.builds(Waiter, st.sampled_from(names), st.booleans()), max_size=12))
    return config, active, waiting


@pytest.fixture(scope="module")
def database() -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    dsn = create_database("runcell_allocation")
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(postgres_concurrency_schema_sql().encode())
            yield conn
    finally:
        drop_database(dsn)


def _granted_in_sql(
    conn: psycopg.Connection[tuple[object, ...]],
    config: LimiterConfig,
    active: dict[str, int],
    waiting: Sequence[Waiter | KeyedWaiter],
) -> list[int]:
    """The positions (into ``waiting``) the database grants, in grant order."""
    with conn.transaction(force_rollback=True):
        conn.execute(
            "INSERT INTO runcell_process VALUES ('p', 'runcell_w_p', 'h', 1, "
            "clock_timestamp() + interval '1 hour')"
        )
        conn.execute(
            "INSERT INTO runcell_limiter (name, config, config_hash) VALUES ('l', %s, 'h')",
            [json.dumps(config.to_dict())],
        )
        for position, waiter in enumerate(waiting):
            conn.execute(
                "INSERT INTO runcell_queue (request_id, limiter, workload, position, "
                "enqueued_at, expires_at, in_progress, process_id, fair_key) "
                "VALUES (%s, 'l', %s, %s, now(), 'infinity', %s, 'p', %s)",
                [
                    f"r{position}",
                    waiter.workload,
                    position,
                    waiter.in_progress,
                    getattr(waiter, "key", None),
                ],
            )
        held = 0
        for workload, n in active.items():
            for _ in range(n):
                held += 1
                conn.execute(
                    "INSERT INTO runcell_lease (limiter, workload, request_id, fencing_token, "
                    "ttl_ms, acquired_at, renewed_at, expires_at) VALUES ('l', %s, %s, %s, "
                    "1000, now(), now(), now() + interval '1 hour')",
                    [workload, f"held{held}", held],
                )
        conn.execute("SELECT runcell_set_limits('l')")
        row = conn.execute(
            "SELECT (runcell_allocate(l, clock_timestamp(), NULL)).requests "
            "FROM runcell_limiter AS l WHERE name = 'l'"
        ).fetchone()
    assert row is not None
    grants = row[0]
    assert isinstance(grants, list)
    return [int(str(grant).removeprefix("r")) for grant in grants]


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(state=states())
def test_the_database_grants_what_allocate_grants_in_the_same_order(
    database: psycopg.Connection[tuple[object, ...]],
    state: tuple[LimiterConfig, dict[str, int], list[Waiter]],
) -> None:
    config, active, waiting = state
    assert _granted_in_sql(database, config, active, waiting) == allocate(config, active, waiting)


def test_a_waiter_whose_process_stopped_renewing_is_passed_over(
    database: psycopg.Connection[tuple[object, ...]],
) -> None:
    config = LimiterConfig.from_mapping({"max_concurrent": 1})
    with database.transaction(force_rollback=True):
        database.execute(
            "INSERT INTO runcell_process VALUES ('gone', 'runcell_w_gone', 'h', 1, "
            "clock_timestamp() - interval '1 second'), ('here', 'runcell_w_here', 'h', 2, "
            "clock_timestamp() + interval '1 hour')"
        )
        database.execute(
            "INSERT INTO runcell_limiter (name, config, config_hash) VALUES ('l', %s, 'h')",
            [json.dumps(config.to_dict())],
        )
        for position, process in enumerate(["gone", "here"]):
            database.execute(
                "INSERT INTO runcell_queue (request_id, limiter, workload, position, "
                "enqueued_at, expires_at, process_id) "
                "VALUES (%s, 'l', 'default', %s, now(), 'infinity', %s)",
                [f"from-{process}", position, process],
            )
        database.execute("SELECT runcell_set_limits('l')")
        row = database.execute(
            "SELECT (runcell_allocate(l, clock_timestamp(), NULL)).requests "
            "FROM runcell_limiter AS l WHERE name = 'l'"
        ).fetchone()
        left = database.execute("SELECT request_id FROM runcell_queue").fetchall()
    assert row is not None
    assert row[0] == ["from-here"]
    assert left == [], "the dead process's row was dropped on the way"


# -- round robin between keys ------------------------------------------------------------

KEYS = [None, "acme", "globex", "initech"]


@dataclass(frozen=True)
class KeyedWaiter:
    workload: str
    in_progress: bool
    key: str | None
    limiters: tuple[str, ...] = ("l",)
    aged: bool = True


@st.composite
def fair_states(
    draw: st.DrawFn,
) -> tuple[LimiterConfig, dict[str, int], list[KeyedWaiter], dict[str | None, int]]:
    """A round-robin limiter's state: limits, slots held, keyed waiters in arrival
    order, and each key's latest grant (some keys never granted)."""
    config, active, plain = draw(states())
    config = LimiterConfig.from_mapping({**config.to_dict(), "fairness": "round_robin"})
    waiting = [KeyedWaiter(w.workload, w.in_progress, draw(st.sampled_from(KEYS))) for w in plain]
    history = {key: draw(st.integers(1, 50)) for key in KEYS if draw(st.booleans())}
    return config, active, waiting, history


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(state=fair_states())
def test_a_round_robin_limiter_grants_what_allocate_members_grants_in_the_same_order(
    database: psycopg.Connection[tuple[object, ...]],
    state: tuple[LimiterConfig, dict[str, int], list[KeyedWaiter], dict[str | None, int]],
) -> None:
    config, active, waiting, history = state
    last_granted: dict[Hashable | None, int] = dict(history.items())
    expected = allocate_members(
        {"l": config}, {"l": active}, waiting, last_granted={"l": last_granted}
    )
    with database.transaction(force_rollback=True):
        for key, token in history.items():
            database.execute(
                "INSERT INTO runcell_fair_history VALUES ('l', %s, %s)", [key or "", token]
            )
        granted = _granted_in_sql(database, config, active, waiting)
    assert granted == expected
