"""How long a run's database steps may keep retrying: the run's own budget.

A slot request carries its deadline and keeps trying while it lasts. The other
database steps of a run (its first start, revocation checks, parking, claiming, the
stored limits registered on first use) are made by code that knows no deadline of its
own; the Celery task sets the run's budget here for all of them, and a backend retries
a dropped connection, a restart or a database not up yet until then::

    with database_patience(Deadline.after_ms(120_000)):
        store.first_start(run_id, 120_000)   # retried for up to 120 s

Outside any ``database_patience`` (or with ``None``) a step has no budget: it fails
closed as before, after at most the backend's connection timeout. The value is a
context variable, so it holds for the thread (or task) that set it and not for
background threads such as the lease keeper.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from .deadline import Deadline

__all__ = ["current_patience", "database_patience"]

_patience: ContextVar[Deadline | None] = ContextVar("runcell_database_patience", default=None)


@contextmanager
def database_patience(deadline: Deadline | None) -> Iterator[None]:
    """Let database steps inside retry transient failures until ``deadline``."""
    token = _patience.set(deadline)
    try:
        yield
    finally:
        _patience.reset(token)


def current_patience() -> Deadline | None:
    """Until when database steps of this context may retry (``None``: no budget)."""
    return _patience.get()
