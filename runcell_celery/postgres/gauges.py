"""Every limiter's live figures for monitoring, read in one query (a metrics scrape).

One row per limiter and workload, from the counts allocation keeps on each limiter
row (``active``, ``waiting``: no ``count(*)`` over leases) and one pass over the
requests still in line (parked ones and the oldest arrival). The keys of a keyed
limiter (rows ``"tenant:acme"`` whose ``parent`` is ``"tenant"``) are summed under
the keyed limiter's name: 100,000 tenants make one row per workload, not 100,000.

Read-only, and bounded: the statement runs under its own ``statement_timeout``
(``SET LOCAL`` in the same round trip), so a database that stalls fails the read
instead of holding the scrape beyond Prometheus's own timeout.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, LiteralString

import psycopg
from psycopg_pool import ConnectionPool, PoolTimeout

from ..errors import ConcurrencyLimiterError
from .connection import redacted, scrubbed

__all__ = ["LIMITER_GAUGES", "WorkloadGauges", "gauges_from_rows", "read_workload_gauges"]

#: One row per (limiter, workload); the read gives up after 5 s (a scrape's default
#: timeout is 10 s); keys summed under their keyed limiter. The
#: effective limit of a workload is the most it could hold now: its ceiling, and
#: the limit less what every other workload holds or keeps reserved (reservations
#: are never lent), as ``runcell_has_room_v3`` decides; summed over the stored keys
#: of a keyed limiter (whose own row holds nothing).
LIMITER_GAUGES: LiteralString = """
SET LOCAL statement_timeout = 5000;
WITH line AS (
    SELECT coalesce(k.parent, q.limiter) AS limiter, q.workload,
           count(*) FILTER (WHERE q.parked) AS parked,
           extract(epoch FROM clock_timestamp() - min(q.enqueued_at))::float8 AS oldest_s
    FROM runcell_queue AS q
    LEFT JOIN runcell_limiter AS k ON k.name = q.limiter
    WHERE q.granted_lease_id IS NULL AND q.expired_at IS NULL
    GROUP BY 1, 2
),
per_row AS (
    SELECT coalesce(l.parent, l.name) AS limiter,
           l.parent IS NOT NULL AS is_key,
           coalesce((l.config ->> 'keyed')::boolean, false) AS keyed,
           l.max_concurrent,
           u.workload,
           least(coalesce(u.ceiling, l.max_concurrent), l.max_concurrent) AS ceiling,
           coalesce(u.held, 0) AS held,
           coalesce(u.waiting, 0) AS waiting,
           greatest(0, least(coalesce(u.ceiling, l.max_concurrent), l.max_concurrent,
                             l.max_concurrent - t.taken
                             + greatest(coalesce(u.held, 0), coalesce(u.reserved, 0)))) AS room,
           (0 < ANY (l.active) OR 0 < ANY (l.waiting)) AS in_use
    FROM runcell_limiter AS l
    CROSS JOIN LATERAL unnest(l.workloads, l.ceilings, l.reserved, l.active, l.waiting)
        AS u(workload, ceiling, reserved, held, waiting)
    CROSS JOIN LATERAL (
        SELECT coalesce(sum(greatest(coalesce(a, 0), coalesce(r, 0))), 0)::integer AS taken
        FROM unnest(l.active, l.reserved) AS x(a, r)
    ) AS t
    WHERE u.workload IS NOT NULL
),
per_limiter AS (
    SELECT limiter,
           bool_or(keyed) FILTER (WHERE NOT is_key) AS keyed,
           max(max_concurrent) FILTER (WHERE NOT is_key) AS max_concurrent
    FROM per_row
    GROUP BY limiter
),
per_workload AS (
    SELECT r.limiter, r.workload,
           max(r.ceiling) FILTER (WHERE NOT r.is_key) AS ceiling,
           sum(r.held)::integer AS held,
           sum(r.waiting)::integer AS waiting,
           coalesce(sum(r.room) FILTER (WHERE r.is_key = p.keyed), 0)::integer AS room,
           count(*) FILTER (WHERE r.is_key AND r.in_use)::integer AS keys_in_use
    FROM per_row AS r
    JOIN per_limiter AS p USING (limiter)
    GROUP BY r.limiter, r.workload
)
SELECT w.limiter, w.workload, p.keyed, p.max_concurrent, w.ceiling, w.room,
       w.held, w.waiting, coalesce(line.parked, 0)::integer, line.oldest_s, w.keys_in_use
FROM per_workload AS w
JOIN per_limiter AS p USING (limiter)
LEFT JOIN line USING (limiter, workload)
WHERE p.max_concurrent IS NOT NULL
ORDER BY w.limiter, w.workload
"""


@dataclass(frozen=True, slots=True)
class WorkloadGauges:
    """One workload of one limiter, now (keys of a keyed limiter summed).

    :param limiter: the limiter's name (a keyed limiter's, never a key's).
    :param workload: the workload's name.
    :param keyed: whether the limiter has a limit per key.
    :param limit: the limiter's ``max_concurrent`` (each key's, for a keyed limiter).
    :param workload_limit: the workload's ceiling (at most ``limit``).
    :param effective_limit: the most slots the workload could hold now, given what
        the other workloads hold or keep reserved; summed over the stored keys.
    :param held: slots held.
    :param queued: requests in line, waiting or parked (not yet granted).
    :param parked: of those, the parked ones (Celery admission deferral).
    :param oldest_wait_s: how long the oldest of those has been in line; ``None``
        when nothing is.
    :param keys_in_use: a keyed limiter's keys holding a slot or with a request in
        line (counted per workload row: the same for each).
    """

    limiter: str
    workload: str
    keyed: bool
    limit: int
    workload_limit: int
    effective_limit: int
    held: int
    queued: int
    parked: int
    oldest_wait_s: float | None
    keys_in_use: int


def read_workload_gauges(pool: ConnectionPool[Any]) -> list[WorkloadGauges]:
    """Run :data:`LIMITER_GAUGES` on a connection of ``pool`` (one round trip).

    Pass the backend's pool (:attr:`PostgresBackend.pool`). The statement has no
    parameters, so it travels as one simple query: its ``SET LOCAL`` and its
    ``SELECT`` run in one implicit transaction, and the timeout ends with it. A
    caller's pool outside autocommit mode gets an explicit transaction.

    :raises ConcurrencyLimiterError: the database failed or did not answer in time.
    """
    try:
        with pool.connection() as conn:
            context = contextlib.nullcontext() if conn.autocommit else conn.transaction()
            with context:
                cursor = conn.execute(LIMITER_GAUGES)
                cursor.nextset()  # past the SET
                return gauges_from_rows(cursor.fetchall())
    except (psycopg.Error, PoolTimeout) as exc:
        where = pool.conninfo if isinstance(pool.conninfo, str) else pool.name
        raise ConcurrencyLimiterError(
            f"reading the limiters' gauges from {redacted(where)} failed: {scrubbed(exc, where)}"
        ) from exc


def gauges_from_rows(rows: Sequence[Sequence[Any]]) -> list[WorkloadGauges]:
    """Build the gauges from the rows of :data:`LIMITER_GAUGES`."""
    return [
        WorkloadGauges(
            limiter=str(limiter),
            workload=str(workload),
            keyed=bool(keyed),
            limit=int(limit),
            workload_limit=int(ceiling if ceiling is not None else limit),
            effective_limit=int(room),
            held=int(held),
            queued=int(waiting),
            parked=int(parked),
            oldest_wait_s=None if oldest is None else max(0.0, float(oldest)),
            keys_in_use=int(keys_in_use),
        )
        for (
            limiter,
            workload,
            keyed,
            limit,
            ceiling,
            room,
            held,
            waiting,
            parked,
            oldest,
            keys_in_use,
        ) in rows
    ]
