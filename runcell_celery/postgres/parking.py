"""Parked requests: the database side of Celery's admission deferral.

A request parked with :meth:`PostgresConcurrencyLimiter.acquire_or_park` keeps its
place in the limiter's queue with the task message beside it. When allocation grants
it, its lease is held and its message must be re-published, exactly once per grant:

* the process that made the grant does it at once (the limiter's
  ``set_parked_granted_handler``);
* processes listening on ``runcell_grant`` see ``!request_id`` lines and try too;
* a sweeper re-publishes grants nobody published within a few seconds.

They all go through :meth:`PostgresBackend.claim_republish
<runcell_celery.postgres.PostgresBackend.claim_republish>`, whose ``UPDATE ... WHERE published_at IS
NULL`` lets exactly one of them publish each grant. If a grant's task does not start
within the lease TTL (the publisher died, the broker lost it), the lease expires and
the request is back in line in its old place, to be granted and published again: a
parked task is never lost. Requests whose deadline passes while parked are taken out
by :meth:`~runcell_celery.postgres.PostgresBackend.take_expired_parked` so their
task can be failed without running.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..ports import ExpiredParked, Republish
from . import statements
from .connection import Database, fetch_all, fetch_one

__all__ = ["REPUBLISH_AFTER_MS"]

#: A grant nobody published within this long is published by the sweeper.
REPUBLISH_AFTER_MS = 2_000


# The functions below predate PostgresBackend and serve the Celery layer until it uses
# the backend's stores (which send the same statements); new code calls the backend.


def claim_republish(
    database: Database, lease_ids: Sequence[str] = (), *, stale_ms: int = REPUBLISH_AFTER_MS
) -> list[Republish]:
    params = {"lease_ids": list(lease_ids), "stale_ms": stale_ms}
    with database.connection() as conn:
        rows = fetch_all(conn, statements.CLAIM_REPUBLISH, params)
    return [Republish(*row) for row in rows]


def take_expired_parked(database: Database) -> list[ExpiredParked]:
    with database.connection() as conn:
        rows = fetch_all(conn, statements.TAKE_EXPIRED_PARKED)
    return [ExpiredParked(*row) for row in rows]


def record_first_start(database: Database, run_id: str, timeout_ms: float) -> float:
    params = {"run_id": run_id, "timeout_ms": timeout_ms}
    with database.connection() as conn:
        return float(fetch_one(conn, statements.FIRST_START, params)[0])
