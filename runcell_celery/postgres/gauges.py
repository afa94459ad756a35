"""Every limiter's live figures for monitoring, read in one bounded query (a scrape).

One row per limiter and workload, from the counts kept on each limiter row (no
``count(*)`` over leases); a keyed limiter's keys are summed under its name, so
100,000 tenants make one row per workload. The statement has its own
``statement_timeout``: a stalled database fails the read, not the scrape.
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

#: One row per (limiter, workload); keys summed under their keyed limiter. The
#: effective limit of a workload is the most it could hold now: its ceiling, and
#: the limit less what every other workload holds or keeps reserved (reservations
#: are never lent), as ``runcell_has_room_v3`` decides; summed over the stored keys
#: of a keyed limiter (whose own row holds nothing). Parsed by :func:`gauges_from_rows`.
WORKLOAD_GAUGES: LiteralString = """
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

#: :data:`WORKLOAD_GAUGES` for a scrape: it gives up after 5 s (a scrape's default
#: timeout is 10 s).
LIMITER_GAUGES: LiteralString = "SET LOCAL statement_timeout = 5000;" + WORKLOAD_GAUGES


@dataclass(frozen=True, slots=True)
class WorkloadGauges:
    """One workload of one limiter, now (a keyed limiter's keys summed): ``limit`` is
    ``max_concurrent``, ``workload_limit`` the workload's ceiling, ``effective_limit`` the
    most it could hold now; ``queued`` counts waiting and parked requests.
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
    """Run :data:`LIMITER_GAUGES` on a connection of ``pool`` (the backend's), in one
    round trip and one transaction.

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
    out = []
    for row in rows:
        limiter, workload, keyed, limit, ceiling, room, held, waiting, parked, oldest, keys = row
        workload_limit = int(ceiling if ceiling is not None else limit)
        oldest_s = None if oldest is None else max(0.0, float(oldest))
        gauges = WorkloadGauges(
            str(limiter), str(workload), bool(keyed), int(limit), workload_limit,
            int(room), int(held), int(waiting), int(parked), oldest_s, int(keys),
        )  # fmt: skip
        out.append(gauges)
    return out
