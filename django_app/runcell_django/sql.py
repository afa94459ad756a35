"""The SQL the app sends that the ORM cannot say simply, named after what it does.

Parameters are always bound. Reads compare with ``statement_timestamp()``, as Django's
``Now()`` does: stable within a statement (ranges use indexes), unlike ``now()`` not the
start of a long transaction. Nothing here writes the limiter's tables, and every query
is bounded by an index (the limiter's own, or ``runcell_event_for_*``/``_occupancy_for_chart``).
"""

from __future__ import annotations

from typing import LiteralString

#: The 95th percentile of the waits of slots acquired in the last ``%s`` minutes.
P95_WAIT_MS: LiteralString = """
SELECT percentile_cont(0.95) WITHIN GROUP (ORDER BY runcell_event.wait_ms)
FROM runcell_event
WHERE runcell_event.limiter = runcell_limiter.name AND runcell_event.type = 'acquired'
  AND runcell_event.occurred_at > statement_timestamp() - %s * interval '1 minute'
"""

#: A keyed limiter's keys summed, in one scan of their rows (``runcell_limiter_keys``):
#: ``{"keys": stored, "in_use": holding or waiting, "workloads": {name: [held, waiting]}}``.
KEY_USAGE: LiteralString = """
CASE WHEN runcell_limiter.parent IS NULL
          AND coalesce((runcell_limiter.config ->> 'keyed')::boolean, false) THEN (
    WITH k AS MATERIALIZED (
        SELECT k.workloads, k.active, k.waiting FROM runcell_limiter AS k
        WHERE k.parent = runcell_limiter.name
    )
    SELECT jsonb_build_object(
        'keys', (SELECT count(*) FROM k),
        'in_use', (SELECT count(*) FROM k WHERE 0 < ANY(k.active) OR 0 < ANY(k.waiting)),
        'workloads', (
            SELECT coalesce(jsonb_object_agg(t.workload, jsonb_build_array(t.held, t.waiting)),
                            '{}'::jsonb)
            FROM (SELECT u.workload, sum(u.held) AS held, sum(u.waiting) AS waiting
                  FROM k, unnest(k.workloads, k.active, k.waiting) AS u(workload, held, waiting)
                  GROUP BY u.workload) AS t)))
END
"""

#: Slots held and requests waiting on a limiter row now, all workloads together.
HELD_TOTAL: LiteralString = "(SELECT coalesce(sum(a), 0) FROM unnest(runcell_limiter.active) AS a)"

WAITING_TOTAL: LiteralString = (
    "(SELECT coalesce(sum(w), 0) FROM unnest(runcell_limiter.waiting) AS w)"
)

#: On a waiting member row of a request over several limiters: the limiters it waits on,
#: asked with the functions allocation decides with (``runcell_group_may_take``,
#: ``runcell_has_room``): no room for it there, or a higher-priority workload waits with
#: room. Empty: the group pass grants it next. Probes by primary key.
GROUP_WAITS_ON: LiteralString = """
CASE WHEN runcell_queue.group_id IS NOT NULL AND runcell_queue.granted_lease_id IS NULL THEN
ARRAY(
    SELECT g.limiter
    FROM unnest(runcell_queue.group_limiters) AS g(limiter)
    LEFT JOIN runcell_queue AS m ON m.request_id = runcell_queue.group_id || '|' || g.limiter
    LEFT JOIN runcell_limiter AS l ON l.name = g.limiter
    LEFT JOIN LATERAL (SELECT array_position(l.workloads, m.workload) AS i) AS w ON true
    WHERE NOT coalesce(
        m.request_id IS NOT NULL
        AND runcell_group_may_take(l, w.i, m.request_id, statement_timestamp())
        AND NOT EXISTS (
            SELECT 1 FROM generate_subscripts(l.workloads, 1) AS k
            WHERE k <> w.i AND l.waiting[k] > 0 AND l.priorities[k] > l.priorities[w.i]
              AND runcell_has_room(l.active, l.ceilings, l.reserved, l.max_concurrent, k)),
        false)
    ORDER BY g.limiter)
END
"""

#: The leases of the requests over several limiters ``%(groups)s``: their leases' request
#: ids are ``"<request id>|<limiter>"``.
GROUP_LEASES: LiteralString = r"""
SELECT substring(request_id FROM '^(.*)\|') AS group_id, lease_id, limiter, workload
FROM runcell_lease
WHERE strpos(request_id, '|') > 0
  AND substring(request_id FROM '^(.*)\|') = ANY(%(groups)s)
ORDER BY group_id, limiter
"""

#: Per limiter and time bucket (``bucket_s`` seconds): the most slots held and requests
#: queued at any sample.
OCCUPANCY_PER_BUCKET: LiteralString = """
SELECT limiter,
       to_timestamp(floor(extract(epoch FROM sampled_at) / %(bucket_s)s) * %(bucket_s)s) AS bucket,
       max(active), max(queued)
FROM (SELECT limiter, sampled_at, sum(active) AS active, sum(queued) AS queued
      FROM runcell_occupancy
      WHERE sampled_at > statement_timestamp() - %(minutes)s * interval '1 minute'
      GROUP BY limiter, sampled_at) AS per_sample
GROUP BY limiter, bucket
ORDER BY limiter, bucket
"""

#: Per limiter and time bucket: p50, p95 and maximum wait of the slots acquired, their
#: number, and the longest wait *in progress or finished* during the bucket: finished
#: waits alone hide a stuck line, so each wait counts in every bucket it spans (a finished
#: one from its end event, one in progress from its queue row, a key's under its keyed
#: limiter). The last bucket's longest is thus the oldest wait now.
WAIT_PER_BUCKET: LiteralString = """
WITH finished AS (
    SELECT limiter, type, occurred_at, wait_ms
    FROM runcell_event
    WHERE type IN ('acquired', 'timed-out', 'wait-cancelled')
      AND occurred_at > statement_timestamp() - %(minutes)s * interval '1 minute'
), spans AS (
    SELECT limiter, occurred_at - wait_ms * interval '1 millisecond' AS started,
           occurred_at AS ended
    FROM finished
    WHERE wait_ms > 0
    UNION ALL
    SELECT coalesce(l.parent, q.limiter), q.enqueued_at, statement_timestamp()
    FROM runcell_queue AS q
    LEFT JOIN runcell_limiter AS l ON l.name = q.limiter
    WHERE q.granted_lease_id IS NULL AND q.expired_at IS NULL
), longest AS (
    SELECT spans.limiter, to_timestamp(b::float8) AS bucket,
           max(extract(epoch FROM least(to_timestamp((b + %(bucket_s)s)::float8), ended)
                                  - started) * 1000)::float8 AS ms
    FROM spans,
         -- Through an array: the planner takes a few buckets per wait (as most are),
         -- not its default thousand rows per call, which would cost the plan a JIT.
         unnest(ARRAY(SELECT generate_series(
             floor(extract(epoch FROM greatest(
                 started, statement_timestamp() - %(minutes)s * interval '1 minute'))
                 / %(bucket_s)s) * %(bucket_s)s,
             extract(epoch FROM ended),
             %(bucket_s)s::numeric))) AS b
    GROUP BY spans.limiter, b
), acquired AS (
    SELECT limiter,
           to_timestamp(floor(extract(epoch FROM occurred_at) / %(bucket_s)s) * %(bucket_s)s)
               AS bucket,
           percentile_cont(0.5) WITHIN GROUP (ORDER BY wait_ms) AS p50,
           percentile_cont(0.95) WITHIN GROUP (ORDER BY wait_ms) AS p95,
           max(wait_ms) AS most, count(*) AS n
    FROM finished
    WHERE type = 'acquired'
    GROUP BY limiter, bucket
)
SELECT coalesce(a.limiter, w.limiter) AS limiter, coalesce(a.bucket, w.bucket) AS bucket,
       a.p50, a.p95, a.most, coalesce(a.n, 0), w.ms
FROM acquired AS a
FULL JOIN longest AS w ON w.limiter = a.limiter AND w.bucket = a.bucket
ORDER BY 1, 2
"""

#: Per limiter, failure kind and time bucket: how many runs failed (a request over
#: several limiters under its first). No join, so no JIT plan.
FAILURES_PER_BUCKET: LiteralString = """
SELECT limiter, type,
       to_timestamp(floor(extract(epoch FROM occurred_at) / %(bucket_s)s) * %(bucket_s)s)
           AS bucket,
       count(*)
FROM runcell_event
WHERE type IN ('timed-out', 'queue-full', 'limiter-error', 'config-error', 'lease-lost')
  AND occurred_at > statement_timestamp() - %(minutes)s * interval '1 minute'
GROUP BY limiter, type, bucket
ORDER BY limiter, type, bucket
"""

#: Per limiter: events that full recorder buffers dropped in the window.
DROPPED_PER_LIMITER: LiteralString = """
SELECT limiter, sum(dropped)
FROM runcell_event
WHERE type = 'events-dropped'
  AND occurred_at > statement_timestamp() - %(minutes)s * interval '1 minute'
GROUP BY limiter
"""

#: One occupancy sample per configured workload, once per interval for the whole fleet
#: (the first recorder to reach an interval writes it); a keyed limiter as the sum over
#: its keys, which are not sampled one by one.
SAMPLE_OCCUPANCY: LiteralString = """
WITH sample AS (
    SELECT to_timestamp(floor(extract(epoch FROM statement_timestamp()) * 1000
                              / %(interval_ms)s) * %(interval_ms)s / 1000.0) AS at
), workloads AS (
    SELECT l.name AS limiter, w.workload, w.i,
           coalesce((l.config ->> 'keyed')::boolean, false) AS keyed
    FROM runcell_limiter AS l,
         unnest(l.workloads) WITH ORDINALITY AS w(workload, i)
    WHERE l.parent IS NULL
)
INSERT INTO runcell_occupancy (limiter, workload, sampled_at, active, queued)
SELECT w.limiter, w.workload, sample.at,
       CASE WHEN w.keyed
            THEN (SELECT coalesce(sum(k.active[w.i]), 0) FROM runcell_limiter AS k
                  WHERE k.parent = w.limiter)
            ELSE (SELECT count(*) FROM runcell_lease AS a
                  WHERE a.limiter = w.limiter AND a.workload = w.workload
                    AND a.expires_at > statement_timestamp()) END,
       CASE WHEN w.keyed
            THEN (SELECT coalesce(sum(k.waiting[w.i]), 0) FROM runcell_limiter AS k
                  WHERE k.parent = w.limiter)
            ELSE (SELECT count(*) FROM runcell_queue AS q
                  WHERE q.limiter = w.limiter AND q.workload = w.workload
                    AND q.granted_lease_id IS NULL
                    AND q.expires_at > statement_timestamp()) END
FROM sample, workloads AS w
WHERE NOT EXISTS (SELECT 1 FROM runcell_occupancy AS o WHERE o.sampled_at = sample.at)
ON CONFLICT (limiter, workload, sampled_at) DO NOTHING
"""
