"""Identifiers for runs, slot requests and leases.

Request ids are made on every slot use, so they come from a per-process random prefix
and a counter (about ten times cheaper than ``uuid4``) and are still unique across
processes and hosts. The prefix is drawn again in a forked child (Celery prefork), so
parent and child never hand out the same id.
"""

from __future__ import annotations

import itertools
import os
import uuid

__all__ = ["new_request_id", "new_run_id"]


def _fresh_prefix() -> str:
    return uuid.uuid4().hex[:16]


_prefix = _fresh_prefix()
_counter = itertools.count(1)


def _after_fork() -> None:
    global _prefix, _counter
    _prefix = _fresh_prefix()
    _counter = itertools.count(1)


os.register_at_fork(after_in_child=_after_fork)


def new_request_id() -> str:
    """Return a process-unique, globally unique id for one slot request."""
    return f"{_prefix}-{next(_counter):x}"


def new_run_id() -> str:
    """Return a new run id (a UUID, as Celery task ids are)."""
    return str(uuid.uuid4())
