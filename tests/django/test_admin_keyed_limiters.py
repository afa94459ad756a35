"""What the limiters pages show of a keyed limiter and its keys (issue 12).

A real keyed PostgreSQL limiter ``tenant`` (2 slots per key) on the test database;
slots held with ``slot(tenant.key(...))`` in this thread while the pages are read:

* ``zeta``: 2 held (full) and 1 request waiting (a thread blocked on a third slot);
* ``alpha``: 2 held; ``mid``: 1 held; ``beta``: used once, idle (its row stays: the
  purge loop is switched off so that no row goes while a test reads).

By name the keys sort alpha, beta, mid, zeta; busiest first they are zeta, alpha, mid,
beta — so an ordering by name cannot pass for the busiest-first one.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack
from typing import Any, LiteralString
from urllib.parse import urlencode

import psycopg
import pytest
from django.contrib.admin.utils import quote
from django.db import connection
from django.test import Client, override_settings
from django.test.utils import CaptureQueriesContext

from runcell_celery import slot
from runcell_celery.postgres import PostgresBackend, PostgresConcurrencyLimiter
from runcell_celery.postgres import keyed as keyed_module
from runcell_django.admin import LimiterAdmin
from tests.conftest import wait_until
from tests.django.test_admin_pages import _cells, _CellText, _text
from tests.support.page_queries import page_statements, reads

pytestmark = pytest.mark.django_db

ADMIN = "/admin/runcell_django"
LIMITERS = f"{ADMIN}/limiter/"
BUSIEST_FIRST = ["tenant:zeta", "tenant:alpha", "tenant:mid", "tenant:beta"]


def _change_url(name: str) -> str:
    # Quoted as the admin quotes primary keys: "tenant:acme" -> "tenant_3Aacme".
    return f"{LIMITERS}{quote(name)}/change/"


def _waiting(dsn: str, name: str) -> list[int]:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT waiting FROM runcell_limiter WHERE name = %s", [name]).fetchone()
    return list(row[0]) if row else []


def _make_keys(dsn: str, keyed: str, keys: list[str]) -> None:
    """Key rows made as a key's first operation makes them (``runcell_create_key``),
    then the table's statistics brought up to date."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "SELECT runcell_create_key(%s || ':' || k) FROM unnest(%s::text[]) AS k",
            [keyed, keys],
        )
        conn.execute("ANALYZE runcell_limiter")


@pytest.fixture
def no_purge(monkeypatch: pytest.MonkeyPatch) -> None:
    """Idle keys stay while a test reads (the purge loop's first step ends it)."""
    monkeypatch.setattr(keyed_module, "_purge_step", lambda keys: None)


@pytest.fixture
def superuser(admin_client_for: Callable[..., Client]) -> Client:
    return admin_client_for(superuser=True)


@pytest.fixture
def tenant(
    pg_limiter: Callable[..., PostgresConcurrencyLimiter], test_dsn: str, no_purge: None
) -> Iterator[PostgresConcurrencyLimiter]:
    """``tenant`` with the busy keys of the module's docstring, held while the test runs."""
    limiter = pg_limiter(name="tenant", max_concurrent=2, max_queued=50, keyed=True)
    pg_limiter(name="claude", max_concurrent=3)  # an ordinary limiter beside it
    failures: list[BaseException] = []

    def wait_for_zeta() -> None:
        try:
            with slot(limiter.key("zeta")):
                pass
        except BaseException as exc:  # reported below
            failures.append(exc)

    waiter = threading.Thread(target=wait_for_zeta, name="keyed-admin-waiter", daemon=True)
    with ExitStack() as held:
        with slot(limiter.key("beta")):
            pass
        for key, slots in (("zeta", 2), ("alpha", 2), ("mid", 1)):
            for _ in range(slots):
                held.enter_context(slot(limiter.key(key)))
        waiter.start()
        wait_until(lambda: _waiting(test_dsn, "tenant:zeta") == [1] or failures, "zeta waits")
        assert not failures, failures
        yield limiter
    waiter.join(30)
    assert not failures, failures


def test_the_limiters_page_hides_keys_and_says_a_limiter_is_keyed_with_its_keys_in_use(
    superuser: Client, tenant: PostgresConcurrencyLimiter
) -> None:
    html = _text(superuser, LIMITERS)
    assert _cells(html, "name") == ["claude", "tenant"]
    limits = dict(zip(_cells(html, "name"), _cells(html, "limits"), strict=True))
    assert limits["claude"] == "3 slots · max queued no limit"
    assert limits["tenant"] == (  # beta is idle: not in use
        "per key: 2 slots · max queued 50 keyed · 3 keys in use · busiest keys"
    )
    assert f'href="{LIMITERS}?keys_of=tenant"' in html
    occupancy = dict(zip(_cells(html, "name"), _cells(html, "occupancy"), strict=True))
    assert occupancy["tenant"] == "all keys 5 · 2 per key default 5"  # summed over its keys
    queued = dict(zip(_cells(html, "name"), _cells(html, "queued"), strict=True))
    assert queued["tenant"] == "1 (default 1)"
    # The filter offers the keys of each keyed limiter, and hides them by default.
    assert "hidden (limiters only)" in html
    assert "of tenant" in html
    assert "of claude" not in html


def test_the_keys_filter_lists_the_keys_of_one_keyed_limiter_busiest_first(
    superuser: Client,
    tenant: PostgresConcurrencyLimiter,
    pg_limiter: Callable[..., PostgresConcurrencyLimiter],
    test_dsn: str,
) -> None:
    pg_limiter(name="region", max_concurrent=1, keyed=True)
    _make_keys(test_dsn, "region", ["eu", "us"])

    html = _text(superuser, f"{LIMITERS}?keys_of=tenant")
    assert _cells(html, "name") == BUSIEST_FIRST
    assert _cells(html, "limits") == ["2 slots · max queued 50 key of tenant"] * 4
    assert f'href="{_change_url("tenant")}"' in html
    occupancy = _cells(html, "occupancy")
    assert occupancy[0] == "all workloads 2/2 default 2/2"
    assert _cells(html, "queued")[0] == "1 (default 1)"

    everything = _cells(_text(superuser, f"{LIMITERS}?keys_of=__all__"), "name")
    assert sorted(everything) == sorted([*BUSIEST_FIRST, "region:eu", "region:us"])
    assert everything[:3] == BUSIEST_FIRST[:3]  # busiest first over all keys too

    # A column header click still orders as asked (by name, descending).
    by_name = _cells(_text(superuser, f"{LIMITERS}?keys_of=tenant&o=-0"), "name")
    assert by_name == sorted(BUSIEST_FIRST, reverse=True)


def test_a_search_finds_keys_by_name_though_keys_are_hidden_by_default(
    superuser: Client, tenant: PostgresConcurrencyLimiter
) -> None:
    assert _cells(_text(superuser, f"{LIMITERS}?q=alph"), "name") == ["tenant:alpha"]
    assert _cells(_text(superuser, f"{LIMITERS}?q=ZETA"), "name") == ["tenant:zeta"]
    assert _cells(_text(superuser, f"{LIMITERS}?q=clau"), "name") == ["claude"]
    # Within one keyed limiter's keys, busiest first: "et" is in zeta and beta.
    assert _cells(_text(superuser, f"{LIMITERS}?keys_of=tenant&q=et"), "name") == [
        "tenant:zeta",
        "tenant:beta",
    ]


def test_a_keyed_limiters_page_lists_its_busiest_keys_and_links_to_all_of_them(
    superuser: Client, tenant: PostgresConcurrencyLimiter
) -> None:
    html = _text(superuser, _change_url("tenant"))
    rows = _key_rows(html)
    assert [key for key, _held, _queued in rows] == ["zeta", "alpha", "mid", "beta"]
    assert rows[0] == ("zeta", "all workloads 2/2 default 2/2", "1 (default 1)")
    assert rows[2] == ("mid", "all workloads 1/2 default 1/2", "0")
    assert rows[3] == ("beta", "all workloads 0/2 default 0/2", "0")
    assert f'href="{_change_url("tenant:zeta")}"' in html
    assert f'href="{LIMITERS}?{urlencode({"keys_of": "tenant"})}"' in html
    assert "3 keys in use (slots held or requests waiting), 4 stored" in _plain(html)


def test_the_busiest_keys_table_is_bounded(
    superuser: Client, tenant: PostgresConcurrencyLimiter, test_dsn: str
) -> None:
    _make_keys(test_dsn, "tenant", [f"idle-{i:03d}" for i in range(40)])
    rows = _key_rows(_text(superuser, _change_url("tenant")))
    assert len(rows) == LimiterAdmin.BUSIEST_KEYS == 20
    assert [key for key, _held, _queued in rows[:3]] == ["zeta", "alpha", "mid"]


def test_a_keys_page_links_to_its_keyed_limiter_whose_limits_it_has(
    superuser: Client, tenant: PostgresConcurrencyLimiter
) -> None:
    html = _text(superuser, _change_url("tenant:alpha"))
    assert f'<a href="{_change_url("tenant")}">tenant</a>' in html
    assert "its limits are the keyed limiter&#x27;s" in html
    assert "Busiest keys" not in html
    # A non-keyed limiter's page has neither.
    plain = _text(superuser, _change_url("claude"))
    assert "Keyed limiter" not in plain
    assert "Busiest keys" not in plain


def test_a_keys_settings_are_compared_with_its_keyed_limiters_in_runcell(
    superuser: Client, tenant: PostgresConcurrencyLimiter
) -> None:
    from django.conf import settings

    def status(limits: Mapping[str, Any]) -> dict[str, str]:
        runcell = {**settings.RUNCELL, "LIMITERS": {"tenant": limits}}
        with override_settings(RUNCELL=runcell):
            html = _text(superuser, f"{LIMITERS}?keys_of=tenant")
        return dict(zip(_cells(html, "name"), _cells(html, "settings_status"), strict=True))

    same = status({"max_concurrent": 2, "max_queued": 50, "keyed": True})
    assert set(same.values()) == {"same as RUNCELL"}, same
    differs = status({"max_concurrent": 3, "max_queued": 50, "keyed": True})
    assert all(s.startswith("differs from RUNCELL:") for s in differs.values()), differs
    assert "max_concurrent" in differs["tenant:alpha"]
    # Without RUNCELL naming the keyed limiter, its keys are not in RUNCELL either.
    assert (
        _cells(_text(superuser, f"{LIMITERS}?keys_of=tenant"), "settings_status")
        == ["not in RUNCELL"] * 4
    )


def test_the_leases_page_filtered_by_a_keyed_limiter_lists_its_keys_leases(
    superuser: Client, tenant: PostgresConcurrencyLimiter
) -> None:
    html = _text(superuser, f"{ADMIN}/lease/?limiter=tenant")
    assert sorted(_cells(html, "limiter_workload")) == [
        "tenant:alpha / default",
        "tenant:alpha / default",
        "tenant:mid / default",
        "tenant:zeta / default",
        "tenant:zeta / default",
    ]
    # Keys are not offered one by one (there may be 100,000): their keyed limiter is.
    assert 'href="?limiter=tenant"' in html
    assert "?limiter=tenant%3Azeta" not in html
    waiting = _text(superuser, f"{ADMIN}/queueentry/?limiter=tenant")
    assert _cells(waiting, "limiter_workload") == ["tenant:zeta / default"]


# -- queries ----------------------------------------------------------------------------


@pytest.fixture
def backend_statements(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any]]:
    """Every statement the PostgreSQL backend runs on its pool for this test's thread (run
    for real, listed): the page is rendered on it, while background threads other tests
    left (counters, recorders) may write through a backend too and are not the page's."""
    sent: list[tuple[str, Any]] = []
    fetch = PostgresBackend._fetch
    page_thread = threading.get_ident()

    def listed(
        self: PostgresBackend, query: LiteralString, params: Mapping[str, Any] | None = None
    ) -> list[tuple[Any, ...]]:
        if threading.get_ident() == page_thread:
            sent.append((query, params))
        return fetch(self, query, params)

    monkeypatch.setattr(PostgresBackend, "_fetch", listed)
    return sent


#: Page -> the most queries it may make: ``SET LOCAL jit = off``, session and user, then
#: the page's own. Lists: the filter's keyed limiters, the paginator's count, the rows
#: (the keys' counts are subqueries of it), and the rows' live counts on the backend's
#: pool. A keyed limiter's page: its row and live counts, the busiest keys and theirs.
KEYED_PAGES = {
    LIMITERS: 7,
    f"{LIMITERS}?keys_of=tenant": 7,
    f"{LIMITERS}?keys_of=__all__": 7,
    f"{LIMITERS}?q=idle-00": 7,
    f"{LIMITERS}?keys_of=tenant&q=idle": 7,
    _change_url("tenant"): 7,
    _change_url("tenant:zeta"): 5,
}


def _queries_per_page(client: Client, statements: list[tuple[str, Any]]) -> dict[str, int]:
    counts = {}
    for url in KEYED_PAGES:
        statements.clear()
        with CaptureQueriesContext(connection) as captured:
            response = client.get(url)
        assert response.status_code == 200, url
        counts[url] = len(page_statements(captured)) + len(statements)
        # Bounded work per query too: on fresh statistics (the keys' own, not the dead
        # rows other tests left), no plan big enough for PostgreSQL to JIT-compile.
        for sql in reads(captured):
            with connection.cursor() as cursor:
                cursor.execute(f"EXPLAIN {sql}")
                plan = "\n".join(row[0] for row in cursor.fetchall())
            assert "JIT:" not in plan, (url, sql)
    return counts


def test_the_limiters_pages_make_as_many_queries_with_500_keys_as_with_8(
    superuser: Client,
    tenant: PostgresConcurrencyLimiter,
    backend_statements: list[tuple[str, Any]],
    test_dsn: str,
    record_property: Callable[[str, object], None],
) -> None:
    _make_keys(test_dsn, "tenant", [f"idle-{i:03d}" for i in range(4)])
    # A first visit fills Django's process-wide caches (content types): run alone, the
    # test would otherwise count one query more with 8 keys than with 500.
    _queries_per_page(superuser, backend_statements)
    few = _queries_per_page(superuser, backend_statements)
    _make_keys(test_dsn, "tenant", [f"idle-{i:03d}" for i in range(4, 496)])
    with psycopg.connect(test_dsn) as conn:
        row = conn.execute("SELECT count(*) FROM runcell_limiter WHERE parent = 'tenant'")
        assert row.fetchone() == (500,)
    many = _queries_per_page(superuser, backend_statements)
    assert many == few
    for url, most in KEYED_PAGES.items():
        assert many[url] <= most, (url, many[url])
    # A page of keys is a full page: 100 rows, counted in the same queries.
    assert len(_cells(_text(superuser, f"{LIMITERS}?keys_of=tenant"), "name")) == 100
    record_property("queries per page", many)


# -- helpers ----------------------------------------------------------------------------


def _plain(html: str) -> str:
    return " ".join(re.sub(r"<[^>]+>", " ", html).split())


def _column(html: str, css: str) -> list[str]:
    """The text of every cell of class ``css`` (nested tables included)."""
    parser = _CellText("")
    parser.css = css
    parser.feed(html)
    return [" ".join(cell.split()) for cell in parser.cells]


def _key_rows(html: str) -> list[tuple[str, str, str]]:
    """(key, held, queued) of each row of the busiest keys table."""
    names = _column(html, "runcell-key-name")
    held = _column(html, "runcell-key-held")
    queued = _column(html, "runcell-key-queued")
    assert len(names) == len(held) == len(queued), (names, held, queued)
    return list(zip(names, held, queued, strict=True))
