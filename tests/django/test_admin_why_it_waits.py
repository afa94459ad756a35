"""The queue page says why each request waits, and sums the lines up at the top.

Real PostgreSQL limiters on the test database: slots held in this thread, requests
waiting in threads of their own (cancelled at the end: they never hold anything).
The reasons are allocation's rules (:mod:`runcell_celery.allocation`), read from the
limiter rows the page fetches with its queue rows: no query per row.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from html.parser import HTMLParser

import psycopg
import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext

from runcell_celery import ConcurrencyCancelledError, LimiterConfig, slot
from runcell_celery.cancellation import CancellationToken
from runcell_celery.postgres import PostgresConcurrencyLimiter
from runcell_django.waiting import why_it_waits
from tests.conftest import wait_until
from tests.django.test_admin_pages import _cells, _text
from tests.support.page_queries import page_statements

pytestmark = pytest.mark.django_db

QUEUE = "/admin/runcell_django/queueentry/"

MakeLimiter = Callable[..., PostgresConcurrencyLimiter]


@pytest.fixture
def superuser(admin_client_for: Callable[..., Client]) -> Client:
    return admin_client_for(superuser=True)


def _queued(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT count(*) FROM runcell_queue").fetchone()
    return int(row[0]) if row else 0


class _Line:
    """Slots held in this thread, and requests waiting each in a thread of its own."""

    def __init__(self, dsn: str, stack: ExitStack) -> None:
        self.dsn = dsn
        self.stack = stack
        self.cancel = CancellationToken()
        self.threads: list[threading.Thread] = []
        self.failures: list[BaseException] = []

    def hold(self, limiter: PostgresConcurrencyLimiter, workload: str | None = None) -> None:
        self.stack.enter_context(slot(limiter, workload=workload))

    def wait(self, limiter: PostgresConcurrencyLimiter, workload: str | None = None) -> str:
        """Start a request that waits; return its run's id once it is in line."""
        run_id = f"waiter-{uuid.uuid4().hex[:8]}"
        before = _queued(self.dsn)

        def run() -> None:
            from runcell_celery import run as run_context

            try:
                with (
                    run_context(
                        limiter=limiter, workload=workload, run_id=run_id, name="app.tasks.t"
                    ),
                    slot(cancel=self.cancel),
                ):
                    self.failures.append(AssertionError(f"{run_id} was granted"))
            except ConcurrencyCancelledError:
                pass
            except BaseException as exc:  # reported at the end
                self.failures.append(exc)

        thread = threading.Thread(target=run, name=run_id, daemon=True)
        thread.start()
        self.threads.append(thread)
        wait_until(lambda: _queued(self.dsn) == before + 1 or bool(self.failures), run_id)
        assert not self.failures, self.failures
        return run_id

    def stop(self) -> None:
        self.cancel.cancel()
        for thread in self.threads:
            thread.join(30)
        assert not self.failures, self.failures


@pytest.fixture
def line(test_dsn: str) -> Iterator[_Line]:
    """Waiters are cancelled before the held slots go (they would be granted then)."""
    with ExitStack() as stack:
        made = _Line(test_dsn, stack)
        try:
            yield made
        finally:
            made.stop()


class _Reasons(HTMLParser):
    """``data-reason`` of each row's why-it-waits cell, by the run id in its row."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[dict[str, str]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if tag == "tr":
            self.rows.append({})
        elif self.rows and "runcell-why" in (found.get("class") or ""):
            self.rows[-1]["reason"] = found.get("data-reason") or ""
        elif self.rows and "runcell-id" in (found.get("class") or ""):
            self.rows[-1]["run_id"] = found.get("title") or ""


def _reasons(html: str) -> dict[str, str]:
    """Each listed request's reason code, by run id."""
    parser = _Reasons()
    parser.feed(html.split('id="result_list"', 1)[1])
    return {row["run_id"]: row["reason"] for row in parser.rows if "run_id" in row}


def test_a_request_behind_its_workloads_ceiling_says_so_and_so_do_those_behind_it(
    superuser: Client, pg_limiter: MakeLimiter, line: _Line
) -> None:
    limiter = pg_limiter(
        max_concurrent=3,
        workloads={
            "interactive": {"reserved": 1, "priority": 10},
            "background": {"max_concurrent": 2},
        },
    )
    line.hold(limiter, "background")
    line.hold(limiter, "background")
    first = line.wait(limiter, "background")
    second = line.wait(limiter, "background")
    html = _text(superuser, QUEUE)
    assert _reasons(html) == {first: "ceiling", second: "behind"}
    why = dict(zip(_cells(html, "place"), _cells(html, "why"), strict=True))
    assert why == {
        "#1": "workload at its ceiling (2/2)",
        "#2": "1 ahead in line · workload at its ceiling (2/2)",
    }


def test_a_request_kept_from_slots_another_workload_reserves_says_so(
    superuser: Client, pg_limiter: MakeLimiter, line: _Line
) -> None:
    limiter = pg_limiter(
        max_concurrent=3, workloads={"interactive": {"reserved": 1}, "background": {}}
    )
    line.hold(limiter, "background")
    line.hold(limiter, "background")
    waiter = line.wait(limiter, "background")  # one slot is free, but interactive's
    html = _text(superuser, QUEUE)
    assert _reasons(html) == {waiter: "reservation"}
    assert _cells(html, "why") == ["free slots reserved for interactive 1"]


def test_a_request_waiting_for_the_limit_itself_says_so(
    superuser: Client, pg_limiter: MakeLimiter, line: _Line
) -> None:
    limiter = pg_limiter(max_concurrent=2)
    line.hold(limiter)
    line.hold(limiter)
    waiter = line.wait(limiter)
    html = _text(superuser, QUEUE)
    assert _reasons(html) == {waiter: "limit"}
    assert _cells(html, "why") == ["limit reached (2/2)"]


def test_a_workload_with_room_waits_for_a_higher_priority_one_served_first() -> None:
    # Only between two allocation passes (the next pass grants it): the pure rule.
    config = LimiterConfig.from_mapping(
        {
            "max_concurrent": 4,
            "workloads": {"interactive": {"priority": 10}, "background": {}},
        },
        name="claude",
    )
    active = {"background": 2}
    waiting = {"interactive": 1, "background": 3}
    assert why_it_waits(config, active, waiting, "background").code == "priority"
    assert why_it_waits(config, active, waiting, "interactive").code == "next"
    behind = why_it_waits(config, active, waiting, "background", ahead=2)
    assert (behind.code, behind.text) == ("behind", "2 ahead in line · interactive has priority")


def test_the_summary_gives_each_workloads_waiting_parked_oldest_wait_and_reason(
    superuser: Client, pg_limiter: MakeLimiter, line: _Line
) -> None:
    limiter = pg_limiter(
        name="claude",
        max_concurrent=3,
        workloads={"interactive": {"reserved": 1}, "background": {"max_concurrent": 2}},
    )
    other = pg_limiter(name="gpt", max_concurrent=1)
    line.hold(limiter, "background")
    line.hold(limiter, "background")
    line.hold(other)
    for _ in range(3):
        line.wait(limiter, "background")
    line.wait(other)
    html = _text(superuser, QUEUE)
    summary = _summary(html)
    assert summary["claude / background"][:4] == ["2/2", "3", "0", "0"]
    assert summary["claude / background"][5] == "workload at its ceiling (2/2)"
    assert summary["gpt / default"][:4] == ["1/1", "1", "0", "0"]
    assert summary["gpt / default"][5] == "limit reached (1/1)"
    assert all(row[4].endswith(("ms", "s")) for row in summary.values())  # oldest wait
    # Filters narrow the summary as they narrow the rows.
    assert list(_summary(_text(superuser, f"{QUEUE}?limiter=gpt"))) == ["gpt / default"]


def test_the_queue_page_makes_as_many_queries_for_five_limiters_as_for_one(
    superuser: Client, pg_limiter: MakeLimiter, line: _Line
) -> None:
    def queries() -> int:
        with CaptureQueriesContext(connection) as captured:
            assert superuser.get(QUEUE).status_code == 200
        return len(page_statements(captured))

    first = pg_limiter(max_concurrent=1)
    line.hold(first)
    line.wait(first)
    few = queries()
    for _ in range(4):
        limiter = pg_limiter(max_concurrent=1)
        line.hold(limiter)
        line.wait(limiter)
        line.wait(limiter)
    assert queries() == few


def _summary(html: str) -> dict[str, list[str]]:
    """The summary's rows: limiter / workload -> the other cells' text."""

    class Rows(HTMLParser):
        def __init__(self) -> None:
            super().__init__()
            self.rows: list[list[str]] = []
            self.cell: list[str] | None = None

        def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
            if tag == "tr" and "runcell-summary-row" in (dict(attrs).get("class") or ""):
                self.rows.append([])
            elif tag == "td" and self.rows is not None and self.cell is None and self.rows:
                self.cell = []

        def handle_endtag(self, tag: str) -> None:
            if tag == "td" and self.cell is not None:
                self.rows[-1].append(" ".join("".join(self.cell).split()))
                self.cell = None

        def handle_data(self, data: str) -> None:
            if self.cell is not None:
                self.cell.append(data)

    section = html.split('class="runcell-queue-summary', 1)[1].split("</section>", 1)[0]
    parser = Rows()
    parser.feed(section)
    return {row[0]: row[1:] for row in parser.rows}
