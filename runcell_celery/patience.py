"""How long a run's database steps may keep retrying: the run's own budget.

A run's database steps other than its slot requests (first start, parking, claiming,
stored limits) know no deadline of their own: the Celery task sets the run's budget
here, and a backend retries transient failures until then. Without one a step fails
closed after the connection timeout. A context variable: background threads (the
keeper) never inherit it.
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
