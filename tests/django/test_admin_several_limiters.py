"""What the admin shows of requests over several limiters (issue 12).

Real PostgreSQL limiters on the test database: ``slot(a, b)`` held in this thread makes
a group of leases (``"<request id>|a"``, ``"<request id>|b"``); the same request made in
a thread while ``b`` is full waits as a group of queue rows, one per limiter. Events of
``slot(openai, gpt_4o, tenant.key("acme"))`` are recorded with every limiter and the key.
"""

from __future__ import annotations

import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack

import psycopg
import pytest
from django.contrib.admin.utils import quote
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from runcell_celery import (
    ConcurrencyCancelledError,
    add_event_listener,
    remove_event_listener,
    slot,
)
from runcell_celery.cancellation import CancellationToken
from runcell_celery.postgres import PostgresConcurrencyLimiter
from runcell_django.models import ConcurrencyEvent
from runcell_django.recorder import EventRecorder
from tests.conftest import wait_until
from tests.django.test_admin_pages import _cells, _text
from tests.support.page_queries import page_statements

pytestmark = pytest.mark.django_db

ADMIN = "/admin/runcell_django"
EVENTS = f"{ADMIN}/concurrencyevent/"
LEASES = f"{ADMIN}/lease/"
QUEUE = f"{ADMIN}/queueentry/"

MakeLimiter = Callable[..., PostgresConcurrencyLimiter]


@pytest.fixture
def superuser(admin_client_for: Callable[..., Client]) -> Client:
    return admin_client_for(superuser=True)


def _queued_groups(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT count(DISTINCT group_id) FROM runcell_queue WHERE group_id IS NOT NULL"
        ).fetchone()
    return int(row[0]) if row else 0


class _Waiters:
    """Requests over several limiters, each waiting in a thread of its own until the
    test ends (then cancelled: they never hold anything)."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.cancel = CancellationToken()
        self.threads: list[threading.Thread] = []
        self.failures: list[BaseException] = []

    def wait(self, *limiters: PostgresConcurrencyLimiter) -> str:
        """Start one request over ``limiters``; return its id once it waits."""
        request_id = f"grp-{uuid.uuid4().hex[:8]}"
        before = _queued_groups(self.dsn)

        def run() -> None:
            try:
                with slot(*limiters, request_id=request_id, cancel=self.cancel):
                    self.failures.append(AssertionError(f"{request_id} was granted"))
            except ConcurrencyCancelledError:
                pass
            except BaseException as exc:  # reported by the fixture
                self.failures.append(exc)

        thread = threading.Thread(target=run, name=f"group-waiter-{request_id}", daemon=True)
        thread.start()
        self.threads.append(thread)
        wait_until(
            lambda: _queued_groups(self.dsn) == before + 1 or bool(self.failures),
            f"{request_id} waits",
        )
        assert not self.failures, self.failures
        return request_id

    def stop(self) -> None:
        self.cancel.cancel()
        for thread in self.threads:
            thread.join(30)
        assert not any(thread.is_alive() for thread in self.threads)
        assert not self.failures, self.failures


@pytest.fixture
def waiters(test_dsn: str, held: ExitStack) -> Iterator[_Waiters]:
    """Cancelled before the held slots go (they would be granted then)."""
    made = _Waiters(test_dsn)
    yield made
    made.stop()


@pytest.fixture
def held() -> Iterator[ExitStack]:
    """Slots held in this thread until the test ends."""
    with ExitStack() as stack:
        yield stack


def _by_row(html: str, field: str) -> dict[str, str]:
    """``field``'s cell of each queue row, by its "limiter / workload" cell (unique here)."""
    rows = _cells(html, "limiter_workload")
    assert len(set(rows)) == len(rows), rows
    return dict(zip(rows, _cells(html, field), strict=True))


# -- events -----------------------------------------------------------------------------


def test_events_of_a_request_over_several_limiters_are_recorded_with_every_limiter_and_the_key(
    superuser: Client, pg_limiter: MakeLimiter
) -> None:
    openai = pg_limiter(name="openai", max_concurrent=2)
    gpt_4o = pg_limiter(name="gpt-4o", max_concurrent=2)
    tenant = pg_limiter(name="tenant", max_concurrent=1, keyed=True)
    recorder = EventRecorder()
    add_event_listener(recorder)
    try:
        with slot(openai, gpt_4o, tenant.key("acme")):
            pass
        with slot(openai):
            pass
    finally:
        remove_event_listener(recorder)
    assert recorder.flush() == 4

    rows = list(ConcurrencyEvent.objects.order_by("id"))
    assert [(e.type, e.limiter, e.limiters, e.key) for e in rows] == [
        ("acquired", "openai", ["openai", "gpt-4o", "tenant:acme"], "acme"),
        ("released", "openai", ["openai", "gpt-4o", "tenant:acme"], "acme"),
        ("acquired", "openai", None, None),
        ("released", "openai", None, None),
    ]

    html = _text(superuser, EVENTS)
    assert _cells(html, "request_limiters") == [
        "openai",
        "openai",
        "openai + gpt-4o + tenant:acme",
        "openai + gpt-4o + tenant:acme",
    ]
    assert _cells(html, "key_link") == ["-", "-", "acme", "acme"]
    assert 'href="?key=acme"' in html

    # Filtered and searched by key.
    assert _cells(_text(superuser, f"{EVENTS}?key=acme"), "key_link") == ["acme", "acme"]
    assert _cells(_text(superuser, f"{EVENTS}?key=other"), "key_link") == []
    assert (
        _cells(_text(superuser, f"{EVENTS}?q=acme"), "request_limiters")
        == ["openai + gpt-4o + tenant:acme"] * 2
    )

    # An event's page names every limiter and the key.
    page = _text(superuser, f"{EVENTS}{rows[0].pk}/change/")
    assert '<div class="readonly">openai, gpt-4o, tenant:acme</div>' in page
    assert '<div class="readonly">acme</div>' in page


# -- the queue --------------------------------------------------------------------------


def test_a_queued_request_over_several_limiters_shows_its_other_limiters_and_what_it_waits_on(
    superuser: Client, pg_limiter: MakeLimiter, waiters: _Waiters, held: ExitStack
) -> None:
    a = pg_limiter(name="a", max_concurrent=2)
    b = pg_limiter(name="b", max_concurrent=1)
    single = pg_limiter(name="single", max_concurrent=1)
    held.enter_context(slot(b))
    held.enter_context(slot(single))
    a_holds = ExitStack()
    for _ in range(2):
        a_holds.enter_context(slot(a))
    waiters.wait(a, b)

    # Both full: it waits on both.
    shown = _by_row(_text(superuser, QUEUE), "request_group")
    assert shown == {
        "a / default": "with b — waits on a, b",
        "b / default": "with a — waits on a, b",
    }

    # a has room now: the request still waits, on b only.
    a_holds.close()
    shown = _by_row(_text(superuser, QUEUE), "request_group")
    assert shown == {
        "a / default": "with b — waits on b",
        "b / default": "with a — waits on b",
    }
    assert _queued_groups(waiters.dsn) == 1


def test_a_member_behind_another_request_in_line_waits_there_though_that_limiter_has_room(
    superuser: Client, pg_limiter: MakeLimiter, waiters: _Waiters, held: ExitStack
) -> None:
    a = pg_limiter(name="a", max_concurrent=2)
    b = pg_limiter(name="b", max_concurrent=1)
    c = pg_limiter(name="c", max_concurrent=1)
    held.enter_context(slot(b))
    held.enter_context(slot(c))
    first = waiters.wait(a, b)
    second = waiters.wait(a, c)
    # a has room (nothing held there); the first, ahead of the second in a's line, lacks
    # room in b and holds nothing in a (the waiting rule): the second waits on c only.

    html = _text(superuser, QUEUE)
    rows = _cells(html, "limiter_workload")
    groups = _cells(html, "request_group")
    assert sorted(zip(rows, groups, strict=True)) == [
        ("a / default", "with b — waits on b"),
        ("a / default", "with c — waits on c"),
        ("b / default", "with a — waits on b"),
        ("c / default", "with a — waits on c"),
    ]
    # A row's page says it too, with the request's id.
    page = _text(superuser, f"{QUEUE}{quote(f'{second}|c')}/change/")
    assert "with a — waits on c" in page
    assert f'<div class="readonly">{second}</div>' in page
    assert first != second


def test_a_queued_request_over_one_limiter_shows_no_other_limiters(
    superuser: Client, pg_limiter: MakeLimiter, waiters: _Waiters, held: ExitStack
) -> None:
    a = pg_limiter(name="a", max_concurrent=1)
    b = pg_limiter(name="b", max_concurrent=1)
    held.enter_context(slot(a))
    failures: list[BaseException] = []

    def wait_alone() -> None:
        try:
            with slot(a, cancel=waiters.cancel):
                pass
        except ConcurrencyCancelledError:
            pass
        except BaseException as exc:
            failures.append(exc)

    thread = threading.Thread(target=wait_alone, name="single-waiter", daemon=True)
    thread.start()
    waiters.threads.append(thread)
    wait_until(lambda: _queue_rows(waiters.dsn) == 1 or bool(failures), "a single waits")
    waiters.wait(a, b)
    html = _text(superuser, QUEUE)
    groups = _cells(html, "request_group")
    assert sorted(groups) == ["-", "with a — waits on a", "with b — waits on a"]
    assert not failures, failures


def _queue_rows(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT count(*) FROM runcell_queue").fetchone()
    return int(row[0]) if row else 0


# -- leases -----------------------------------------------------------------------------


def test_a_lease_of_a_request_over_several_limiters_shows_the_others_held_with_it(
    superuser: Client, pg_limiter: MakeLimiter, held: ExitStack
) -> None:
    a = pg_limiter(name="a", max_concurrent=4)
    b = pg_limiter(name="b", max_concurrent=3)
    c = pg_limiter(name="c", max_concurrent=3)
    ab = held.enter_context(slot(a, b, request_id="req-ab"))
    held.enter_context(slot(a, c, request_id="req-ac"))
    held.enter_context(slot(a, b, c, request_id="req-abc"))
    held.enter_context(slot(a, request_id="req-alone"))

    html = _text(superuser, LEASES)
    rows = _cells(html, "limiter_workload")
    links = [cell.replace(" ,", ",") for cell in _cells(html, "held_with")]  # one link each
    shown = sorted(zip(rows, links, strict=True))
    assert shown == [
        ("a / default", "-"),
        ("a / default", "with b"),
        ("a / default", "with b, c"),
        ("a / default", "with c"),
        ("b / default", "with a"),
        ("b / default", "with a, c"),
        ("c / default", "with a"),
        ("c / default", "with a, b"),
    ]
    # Each name links to that lease's page, which shows the others too.
    b_lease = next(lease for lease in ab.leases if lease.limiter == "b")
    b_url = f"{LEASES}{quote(b_lease.lease_id)}/change/"
    assert f'<a href="{b_url}">b</a>' in html
    page = _text(superuser, b_url)
    assert "req-ab|b" in page
    assert "with a" in page


# -- queries ----------------------------------------------------------------------------


def _queries(client: Client, url: str) -> int:
    with CaptureQueriesContext(connection) as captured:
        response = client.get(url)
    assert response.status_code == 200, url
    return len(page_statements(captured))


def test_the_queue_and_leases_pages_make_as_many_queries_with_five_groups_as_with_one(
    superuser: Client, pg_limiter: MakeLimiter, waiters: _Waiters, held: ExitStack
) -> None:
    a = pg_limiter(name="a", max_concurrent=10)
    b = pg_limiter(name="b", max_concurrent=1)
    c = pg_limiter(name="c", max_concurrent=10)
    held.enter_context(slot(b))
    held.enter_context(slot(a, c))
    waiters.wait(a, b)
    few = {QUEUE: _queries(superuser, QUEUE), LEASES: _queries(superuser, LEASES)}
    for _ in range(4):
        waiters.wait(a, b, c)
        held.enter_context(slot(a, c))
    many = {QUEUE: _queries(superuser, QUEUE), LEASES: _queries(superuser, LEASES)}
    assert many == few
    # The transaction's SET LOCAL jit, session and user, the filter's limiters, two counts
    # and the rows (what each row waits on is part of the rows' query, and why it waits
    # is read from the limiter rows fetched with it), the queue's summary two (its
    # counts, the limiters they wait on); the leases page adds one for the leases held
    # together.
    assert many[QUEUE] <= 9, many
    assert many[LEASES] <= 8, many

    waits = Counter(
        cell.split(" — ")[1] for cell in _cells(_text(superuser, QUEUE), "request_group")
    )
    assert waits == {
        # Every row waits on b only: a and c have room, and the requests ahead of them
        # there lack room in b, so they hold nothing (the waiting rule).
        "waits on b": 14,
    }
