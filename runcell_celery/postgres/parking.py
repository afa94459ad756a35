"""Parked requests: the database side of Celery's admission deferral.

A request parked with :meth:`PostgresConcurrencyLimiter.acquire_or_park` keeps its
place in the limiter's queue with the task message beside it. When allocation grants
it, its lease is held and its message must be re-published, exactly once per grant:

* the process that made the grant does it at once (``on_parked_granted``);
* processes listening on ``runcell_grant`` see ``!request_id`` lines and try too;
* a sweeper re-publishes grants nobody published within a few seconds.

They all go through :func:`claim_republish`, whose ``UPDATE ... WHERE published_at IS
NULL`` lets exactly one of them publish each grant. If a grant's task does not start
within the lease TTL (the publisher died, the broker lost it), the lease expires and
the request is back in line in its old place, to be granted and published again: a
parked task is never lost. Requests whose deadline passes while parked are taken out
by :func:`take_expired_parked` so their task can be failed without running.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from . import statements
from .connection import Database, fetch_all, fetch_one

__all__ = [
    "ExpiredParked",
    "Republish",
    "claim_republish",
    "record_first_start",
    "take_expired_parked",
]

#: A grant nobody published within this long is published by the sweeper.
REPUBLISH_AFTER_MS = 2_000


@dataclass(frozen=True, slots=True)
class Republish:
    """A granted parked request whose task message this process must publish."""

    limiter: str
    request_id: str
    publication_id: str
    payload: str


@dataclass(frozen=True, slots=True)
class ExpiredParked:
    """A parked request whose deadline passed before it was granted."""

    limiter: str
    request_id: str
    workload: str
    run_id: str | None
    root_run_id: str | None
    parent_run_id: str | None
    holder_name: str | None
    payload: str


def claim_republish(
    database: Database, lease_ids: Sequence[str] = (), *, stale_ms: int = REPUBLISH_AFTER_MS
) -> list[Republish]:
    """Take the right to publish these grants (and any left unpublished past ``stale_ms``)."""
    params = {"lease_ids": list(lease_ids), "stale_ms": stale_ms}
    with database.connection() as conn:
        rows = fetch_all(conn, statements.CLAIM_REPUBLISH, params)
    return [Republish(*row) for row in rows]


def take_expired_parked(database: Database) -> list[ExpiredParked]:
    """Remove parked requests whose deadline passed; return them to be failed."""
    with database.connection() as conn:
        rows = fetch_all(conn, statements.TAKE_EXPIRED_PARKED)
    return [ExpiredParked(*row) for row in rows]


def record_first_start(database: Database, run_id: str, timeout_ms: float) -> float:
    """Return the milliseconds left in the run's budget, recording its first start.

    A redelivered or re-published run finds the deadline of its first start, in
    database time, so its budget is never restarted. What is returned is measured in
    database time too, so this host's clock does not shift it.
    """
    params = {"run_id": run_id, "timeout_ms": timeout_ms}
    with database.connection() as conn:
        deadline, now = fetch_one(conn, statements.FIRST_START, params)
    return (float(deadline) - float(now)) * 1000
