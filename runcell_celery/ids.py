"""Identifiers for runs and slot requests. A request id, made on every slot use, is a
per-process random prefix and a counter (ten times cheaper than ``uuid4``), made anew
in a forked child so parent and child never hand out the same id.
"""

from __future__ import annotations

import itertools
import uuid

from .background import DEFAULT_REGISTRY

__all__ = ["new_request_id", "new_run_id"]


class _Ids:
    def __init__(self) -> None:
        self.prefix = uuid.uuid4().hex[:16]
        self.counter = itertools.count(1)


def new_request_id() -> str:
    """Return a process-unique, globally unique id for one slot request."""
    ids = DEFAULT_REGISTRY.local("ids", _Ids)
    return f"{ids.prefix}-{next(ids.counter):x}"


def new_run_id() -> str:
    """Return a new run id (a UUID, as Celery task ids are)."""
    return str(uuid.uuid4())
