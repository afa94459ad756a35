"""Several limiters work on a database whose collation is not C.

Managed PostgreSQL services create databases with an ``en-US`` collation, where
``gpt-4o`` sorts before ``OpenAI``, ``claude_sonnet`` before ``claude-opus`` and
``tenant:alpha`` before ``tenant:Beta`` -- the other way round from Python's order of
code points (and PostgreSQL's ``C``). Names that order locks are compared byte-wise on
both sides, so a request over such limiters is granted, waits, parks, is claimed and
withdrawn there as on a ``C`` database. Every test here makes its own ``en-US`` (ICU)
database, whatever ``RUNCELL_TEST_COLLATION`` says.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql

from runcell_celery import AcquireRequest, RunLineage, slot
from runcell_celery.ports import Parked
from runcell_celery.postgres import (
    PostgresBackend,
    PostgresConcurrencyLimiter,
    create_postgres_concurrency_limiter,
    postgres_concurrency_schema_sql,
)
from runcell_celery.protocol import Member
from runcell_celery.testing.databases import (
    COLLATION_ENV,
    collation_from_env,
    server_dsn,
    throwaway_database,
)
from tests.support.pg import create_database, drop_database

MakeLimiter = Callable[..., PostgresConcurrencyLimiter]
PAYLOAD = '{"task": "agents.answer", "args": ["acme"]}'
#: Pairs of names in Python's (and C's) order, which en-US sorts the other way round.
PAIRS = [("OpenAI", "gpt-4o"), ("claude-opus", "claude_sonnet")]
#: The columns whose values order locks or are matched by prefix (keys of a limiter).
ORDERED = {
    "runcell_fair_history.fair_key",
    "runcell_fair_history.limiter",
    "runcell_lease.limiter",
    "runcell_lease.workload",
    "runcell_limiter.name",
    "runcell_limiter.parent",
    "runcell_limiter.workloads",
    "runcell_queue.fair_key",
    "runcell_queue.group_id",
    "runcell_queue.group_limiters",
    "runcell_queue.limiter",
    "runcell_queue.workload",
}


@pytest.fixture
def en_us_dsn() -> Iterator[str]:
    dsn = create_database("runcell_en_us", collation="en-US")
    try:
        yield dsn
    finally:
        drop_database(dsn)


@pytest.fixture
def make(en_us_dsn: str) -> MakeLimiter:
    def limiter(name: str, **options: Any) -> PostgresConcurrencyLimiter:
        options.setdefault("poll_interval_ms", 20)
        options.setdefault("max_concurrent", 1)
        return create_postgres_concurrency_limiter(en_us_dsn, name=name, **options)

    return limiter


@pytest.fixture
def backend(en_us_dsn: str) -> Iterator[PostgresBackend]:
    made = PostgresBackend(database=en_us_dsn)
    try:
        yield made
    finally:
        made.close()


def _requests(request_id: str, n: int = 2) -> list[AcquireRequest]:
    return [
        AcquireRequest(
            request_id=request_id, workload="default", lineage=RunLineage(request_id, request_id)
        )
        for _ in range(n)
    ]


def _members(dsn: str, group: str) -> list[tuple[str, bool, bool]]:
    """(limiter, parked, granted) of each waiting member of ``group``, in Python order."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT limiter, parked, granted_lease_id IS NOT NULL FROM runcell_queue "
            "WHERE group_id = %s",
            [group],
        ).fetchall()
    return sorted((r[0], r[1], r[2]) for r in rows)


def test_the_database_sorts_these_names_unlike_python(en_us_dsn: str) -> None:
    names = [*(n for pair in PAIRS for n in pair), "tenant:Beta", "tenant:alpha"]
    with psycopg.connect(en_us_dsn) as conn:
        for first, second in [*PAIRS, ("tenant:Beta", "tenant:alpha")]:
            row = conn.execute("SELECT %s::text < %s::text", [first, second]).fetchone()
            assert row == (False,), f"en-US sorts {first!r} before {second!r} as Python does"
    assert sorted(names) == ["OpenAI", "claude-opus", "claude_sonnet", "gpt-4o", *names[4:]]


@pytest.mark.parametrize(("first", "second"), PAIRS)
def test_a_slot_over_two_limiters_that_en_us_sorts_the_other_way_is_granted(
    make: MakeLimiter, first: str, second: str
) -> None:
    a = make(first, max_concurrent=1)
    b = make(second, max_concurrent=1)
    for limiters in [(a, b), (b, a)]:
        with slot(*limiters) as held:
            assert [lease.limiter for lease in held.leases] == [x.name for x in limiters]
            assert (a.stats().active, b.stats().active) == (1, 1)
        assert (a.stats().active, b.stats().active) == (0, 0)


def test_a_request_over_such_limiters_waits_and_is_granted_when_the_holder_releases(
    make: MakeLimiter,
) -> None:
    a = make("OpenAI", max_concurrent=1)
    b = make("gpt-4o", max_concurrent=1)
    held = b.acquire(_requests("holder", 1)[0])
    waiting = threading.Event()
    entered = threading.Event()
    failures: list[BaseException] = []

    def call() -> None:
        try:
            with slot(b, a):
                entered.set()
        except BaseException as exc:
            failures.append(exc)

    worker = threading.Thread(target=call, daemon=True)
    worker.start()
    try:
        for _ in range(1500):
            if a.stats().queued == 1 and b.stats().queued == 1:
                waiting.set()
                break
            entered.wait(0.01)
        assert waiting.is_set(), f"never waited in both lines: {failures!r}"
        assert a.stats().active == 0, "it holds a slot of OpenAI while it waits"
    finally:
        b.release(held)
        worker.join(20)
    assert failures == []
    assert entered.is_set()
    assert (a.stats().active, b.stats().active, a.stats().queued, b.stats().queued) == (
        0,
        0,
        0,
        0,
    )


def test_keys_beta_and_alpha_of_a_keyed_limiter_are_held_together_and_wait_together(
    make: MakeLimiter,
) -> None:
    tenant = make("tenant", max_concurrent=1, keyed=True)
    beta, alpha = tenant.key("Beta"), tenant.key("alpha")
    with slot(beta, alpha) as held:
        assert [lease.limiter for lease in held.leases] == ["tenant:Beta", "tenant:alpha"]
    holder = alpha.acquire(_requests("holder", 1)[0])
    granted = threading.Event()
    failures: list[BaseException] = []

    def call() -> None:
        try:
            with slot(alpha, beta):
                granted.set()
        except BaseException as exc:
            failures.append(exc)

    worker = threading.Thread(target=call, daemon=True)
    worker.start()
    try:
        for _ in range(1500):
            if beta.stats().queued == 1:
                break
            granted.wait(0.01)
        assert beta.stats().queued == 1, f"never waited for the key: {failures!r}"
    finally:
        alpha.release(holder)
        worker.join(20)
    assert failures == []
    assert granted.is_set()


def test_a_parked_request_over_such_limiters_is_granted_claimed_and_released(
    make: MakeLimiter, en_us_dsn: str, backend: PostgresBackend
) -> None:
    a = make("claude_sonnet", max_concurrent=1)
    b = make("claude-opus", max_concurrent=1)
    held = a.acquire(_requests("holder", 1)[0])

    parked = a.acquire_or_park(
        [Member(x, r) for x, r in zip([a, b], _requests("parked"), strict=True)],
        admission_wait_ms=0,
        payload=PAYLOAD,
    )

    assert isinstance(parked, Parked), parked
    assert _members(en_us_dsn, "parked") == [
        ("claude-opus", True, False),
        ("claude_sonnet", True, False),
    ]
    a.release(held)  # its group pass grants the parked request in both limiters
    assert _members(en_us_dsn, "parked") == [
        ("claude-opus", True, True),
        ("claude_sonnet", True, True),
    ]
    (claim,) = [
        c for c in backend.claim_republish(stale_ms=0) if c.request_id.startswith("parked|")
    ]
    # The message rides on the first member in byte order, whatever the database's.
    assert claim.request_id == "parked|claude-opus"
    assert json.loads(claim.payload) == json.loads(PAYLOAD)
    leases = a.claim_parked([a, b], "parked", claim.publication_id)
    assert isinstance(leases, tuple), leases
    assert [lease.limiter for lease in leases] == ["claude_sonnet", "claude-opus"]
    assert _members(en_us_dsn, "parked") == []
    for limiter, lease in zip([a, b], leases, strict=True):
        limiter.release(lease)
    assert (a.stats().active, b.stats().active) == (0, 0)


def test_a_parked_request_over_such_limiters_is_withdrawn_from_every_line(
    make: MakeLimiter, en_us_dsn: str
) -> None:
    a = make("OpenAI", max_concurrent=1)
    b = make("gpt-4o", max_concurrent=1)
    held = b.acquire(_requests("holder", 1)[0])
    parked = b.acquire_or_park(
        [Member(x, r) for x, r in zip([b, a], _requests("parked"), strict=True)],
        admission_wait_ms=0,
        payload=PAYLOAD,
    )
    assert isinstance(parked, Parked), parked

    b.withdraw_members([b, a], "parked")

    assert _members(en_us_dsn, "parked") == []
    assert (a.stats().queued, b.stats().queued) == (0, 0)
    b.release(held)
    assert (a.stats().active, b.stats().active) == (0, 0)


def _collations(dsn: str) -> dict[str, str | None]:
    """The collation of each text column of the limiter's tables, by table.column."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT table_name || '.' || column_name, collation_name "
            "FROM information_schema.columns WHERE table_name LIKE 'runcell%%' "
            "AND udt_name IN ('text', '_text')"
        ).fetchall()
    return {str(r[0]): r[1] for r in rows}


def test_every_column_holding_a_name_or_key_compares_byte_wise(
    make: MakeLimiter, en_us_dsn: str
) -> None:
    make("OpenAI")  # creates the schema
    collations = _collations(en_us_dsn)
    assert {column: collations.get(column) for column in ORDERED} == dict.fromkeys(ORDERED, "C")


def test_a_database_made_by_an_earlier_revision_gets_byte_wise_names_and_keeps_its_rows(
    make: MakeLimiter, en_us_dsn: str
) -> None:
    # As a database of a revision made before its names were COLLATE "C" stands: those
    # columns in the database's collation, and an earlier schema version recorded.
    with psycopg.connect(en_us_dsn, autocommit=True) as conn:
        conn.execute(postgres_concurrency_schema_sql().encode())
        for column in sorted(ORDERED):
            table, name = column.split(".")
            row = conn.execute(
                "SELECT format_type(atttypid, atttypmod) FROM pg_attribute "
                "WHERE attrelid = %s::regclass AND attname = %s",
                [table, name],
            ).fetchone()
            assert row is not None
            conn.execute(
                sql.SQL('ALTER TABLE {} ALTER COLUMN {} TYPE {} COLLATE "default"').format(
                    sql.Identifier(table), sql.Identifier(name), sql.SQL(row[0])
                )
            )
        conn.execute("UPDATE runcell_schema SET version = version - 1")
        conn.execute(
            "INSERT INTO runcell_fair_history (limiter, fair_key, last_granted) "
            "VALUES ('tenant:acme', 'alpha', 1), ('tenant:acme', 'Beta', 2)"
        )
    assert _collations(en_us_dsn)["runcell_limiter.name"] is None, "already byte-wise"

    a = make("OpenAI")  # applies this revision over the earlier one
    b = make("gpt-4o")

    collations = _collations(en_us_dsn)
    assert {column: collations.get(column) for column in ORDERED} == dict.fromkeys(ORDERED, "C")
    with psycopg.connect(en_us_dsn) as conn:
        keys = conn.execute("SELECT fair_key FROM runcell_fair_history ORDER BY fair_key")
        assert [k for (k,) in keys.fetchall()] == ["Beta", "alpha"]
    with slot(a, b):
        assert (a.stats().active, b.stats().active) == (1, 1)
    make("OpenAI")  # current already: applying it again changes nothing
    assert _collations(en_us_dsn) == collations


def _locale(dsn: str) -> tuple[str, str | None]:
    """(provider, ICU locale) of the database ``dsn`` names: ``i`` ICU, ``c`` libc."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT datlocprovider::text, daticulocale FROM pg_database "
            "WHERE datname = current_database()"
        ).fetchone()
    assert row is not None
    return str(row[0]), row[1]


def test_runcell_test_collation_makes_every_test_database_with_that_icu_locale(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(COLLATION_ENV, "en-US")
    dsn = create_database("runcell_env_collation")
    try:
        assert _locale(dsn) == ("i", "en-US")
    finally:
        drop_database(dsn)
    with throwaway_database(server_dsn()) as made:
        assert _locale(made) == ("i", "en-US")
    monkeypatch.setenv(COLLATION_ENV, "C")
    with throwaway_database(server_dsn()) as made:
        assert _locale(made)[1] is None


def test_a_runcell_test_collation_that_is_not_a_locale_name_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(COLLATION_ENV, "en-US' LOCALE 'x")
    with pytest.raises(ValueError, match="RUNCELL_TEST_COLLATION must be an ICU locale"):
        collation_from_env()
