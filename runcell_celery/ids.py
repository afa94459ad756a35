"""Identifiers for runs, slot requests and leases.

Request ids are made on every slot use, so they come from a per-process random prefix
and a counter (about ten times cheaper than ``uuid4``) and are still unique across
processes and hosts. The prefix is drawn again in a forked child (Celery prefork), so
parent and child never hand out the same id.
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
