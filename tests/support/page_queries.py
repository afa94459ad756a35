"""The statements an admin page sends on Django's connection, as a page makes them.

A page runs in a transaction of its own that plans without JIT (``SET LOCAL jit = off``,
one statement, counted). In production that transaction is a ``BEGIN`` and a ``COMMIT``,
which Django does not list; inside a test's own transaction it is a savepoint, which it
does list: those are left out, so that a page counts the same in both.
"""

from __future__ import annotations

from django.test.utils import CaptureQueriesContext

_SAVEPOINTS = ("SAVEPOINT ", "RELEASE SAVEPOINT ", "ROLLBACK TO SAVEPOINT ")


def page_statements(captured: CaptureQueriesContext) -> list[str]:
    """The SQL of every statement ``captured`` saw, less the test's savepoints."""
    return [q["sql"] for q in captured.captured_queries if not q["sql"].startswith(_SAVEPOINTS)]


def reads(captured: CaptureQueriesContext) -> list[str]:
    """The page's queries that read rows (what ``EXPLAIN`` can plan)."""
    return [sql for sql in page_statements(captured) if sql.lstrip().upper().startswith("SELECT")]
