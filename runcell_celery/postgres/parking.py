"""Parked requests: the database side of Celery's admission deferral.

A request parked with :meth:`PostgresConcurrencyLimiter.acquire_or_park` keeps its
place in the limiter's queue with the task message beside it. When allocation grants
it, its lease is held and its message must be re-published, exactly once per grant:

* the process that made the grant does it at once (the limiter's
  ``set_parked_granted_handler``);
* processes listening on ``runcell_parked`` hear of the grant and try too;
* a sweeper re-publishes grants nobody published within a few seconds.

They all go through :meth:`~runcell_celery.postgres.PostgresBackend.claim_republish`,
whose ``UPDATE ... WHERE published_at IS NULL`` lets exactly one of them publish each
grant. If a grant's task does not start
within the lease TTL (the publisher died, the broker lost it), the lease expires and
the request is back in line in its old place, to be granted and published again: a
parked task is never lost. Requests whose deadline passes while parked are taken out
by :meth:`~runcell_celery.postgres.PostgresBackend.take_expired_parked` so their
task can be failed without running.
"""

from __future__ import annotations

__all__ = ["REPUBLISH_AFTER_MS"]

#: A grant nobody published within this long is published by the sweeper.
REPUBLISH_AFTER_MS = 2_000
