"""Every SQL statement the PostgreSQL limiter sends, named after what it does.

The allocation logic under the limiter row's lock lives in ``schema.sql`` as
PL/pgSQL functions (one round trip each); these statements call them. Parameters are
always bound (``%(name)s``), never formatted into the text.
"""

from __future__ import annotations

from typing import LiteralString

SCHEMA_EXISTS: LiteralString = "SELECT to_regclass('runcell_schema') IS NOT NULL"

SCHEMA_IS_CURRENT: LiteralString = (
    "SELECT EXISTS (SELECT 1 FROM runcell_schema WHERE checksum = %(checksum)s)"
)

#: Serialises schema creation between workers that start at the same moment.
LOCK_SCHEMA: LiteralString = "SELECT pg_advisory_xact_lock(%(key)s)"

REGISTER_LIMITER: LiteralString = """
INSERT INTO runcell_limiter (name, config, config_hash)
VALUES (%(name)s, %(config)s, %(config_hash)s)
ON CONFLICT (name) DO NOTHING
RETURNING name
"""

STORED_LIMITER: LiteralString = """
SELECT config, config_hash FROM runcell_limiter WHERE name = %(name)s FOR UPDATE
"""

REPLACE_LIMITER: LiteralString = """
UPDATE runcell_limiter
SET config = %(config)s, config_hash = %(config_hash)s, updated_at = clock_timestamp()
WHERE name = %(name)s
"""

# An allocation transaction is two round trips: these statements are sent together
# as one simple-query message (client-side binding, see transaction.py).

#: Round trip 1: start the transaction and take the limiter row's lock.
BEGIN_AND_LOCK: LiteralString = """
BEGIN;
SELECT runcell_lock_v2(%(limiter)s, %(release_lease)s::uuid, %(withdraw_request)s,
                       %(request_id)s, %(max_per_workload)s)
"""

#: A release or withdrawal that finds nobody to grant is done in this one round trip.
LOCK_AND_COMMIT: LiteralString = """
BEGIN;
SELECT runcell_lock_v2(%(limiter)s, %(release_lease)s::uuid, %(withdraw_request)s,
                       %(request_id)s, %(max_per_workload)s);
COMMIT
"""

#: Round trip 2: write the decision and commit.
APPLY_AND_COMMIT: LiteralString = """
SELECT runcell_apply_v2(%(limiter)s, %(grants)s, %(caller)s, %(caller_action)s,
                        %(ttl_ms)s, %(queue_ttl_ms)s);
COMMIT
"""

COMMIT: LiteralString = "COMMIT"

POLL: LiteralString = "SELECT runcell_poll_v1(%(limiter)s, %(request_id)s, %(queue_ttl_ms)s)"

#: Renew every lease a process holds on one limiter in one statement.
RENEW: LiteralString = """
UPDATE runcell_lease
SET renewed_at = clock_timestamp(),
    expires_at = clock_timestamp() + ttl_ms * interval '1 millisecond'
WHERE lease_id = ANY(%(lease_ids)s::uuid[])
  AND limiter = %(limiter)s
  AND expires_at > clock_timestamp()
RETURNING lease_id::text
"""

PARK: LiteralString = "SELECT runcell_park_v1(%(limiter)s, %(request_id)s, %(payload)s::jsonb)"

#: A re-published parked task takes the lease granted to it: its queue row goes and
#: the lease is renewed. Only the publication it was sent as can claim it.
CLAIM_PARKED: LiteralString = """
WITH claimed AS (
    DELETE FROM runcell_queue q
    USING runcell_lease l
    WHERE q.request_id = %(request_id)s AND q.limiter = %(limiter)s AND q.parked
      AND q.publication_id = %(publication_id)s::uuid
      AND l.lease_id = q.granted_lease_id AND l.expires_at > clock_timestamp()
    RETURNING q.granted_lease_id
)
UPDATE runcell_lease l
SET picked_up_at = clock_timestamp(), renewed_at = clock_timestamp(),
    expires_at = clock_timestamp() + l.ttl_ms * interval '1 millisecond'
FROM claimed WHERE l.lease_id = claimed.granted_lease_id
RETURNING l.lease_id::text, l.request_id, l.workload, l.fencing_token
"""

#: Take the right to re-publish granted parked tasks, once per grant: those just
#: granted (by lease id), and any whose grant nobody published within ``stale_ms``.
CLAIM_REPUBLISH: LiteralString = """
UPDATE runcell_queue
SET published_at = clock_timestamp(), publication_id = gen_random_uuid()
WHERE granted_lease_id IS NOT NULL AND published_at IS NULL
  AND (granted_lease_id = ANY(%(lease_ids)s::uuid[])
       OR granted_at < clock_timestamp() - %(stale_ms)s * interval '1 millisecond')
RETURNING limiter, request_id, publication_id::text, payload::text
"""

#: Parked requests whose deadline passed while they waited: drop them (their tasks
#: are re-published once more to be failed with a timeout, never run).
TAKE_EXPIRED_PARKED: LiteralString = """
DELETE FROM runcell_queue
WHERE parked AND granted_lease_id IS NULL AND deadline <= clock_timestamp()
RETURNING limiter, request_id, workload, run_id, root_run_id, parent_run_id, holder_name,
          payload::text
"""

#: Record a run's first start (or read it back on redelivery) in database time, and
#: answer with the milliseconds left in its budget (a duration: no host clock involved).
FIRST_START: LiteralString = """
INSERT INTO runcell_run (run_id, first_started_at, deadline)
VALUES (%(run_id)s, clock_timestamp(),
        clock_timestamp() + %(timeout_ms)s * interval '1 millisecond')
ON CONFLICT (run_id) DO UPDATE SET run_id = EXCLUDED.run_id
RETURNING (extract(epoch FROM deadline - clock_timestamp()) * 1000)::float8
"""

#: Add a batch of counts (one row per task name and limiter) in one statement.
ADD_ADMISSION_COUNTS: LiteralString = """
INSERT INTO runcell_admission_counter AS c (task_name, limiter, deliveries, deferrals,
    provider_attempts, provider_failures, concurrency_failures, updated_at)
SELECT t, l, d, df, pa, pf, cf, clock_timestamp()
FROM unnest(%(task_names)s::text[], %(limiters)s::text[], %(deliveries)s::bigint[],
            %(deferrals)s::bigint[], %(provider_attempts)s::bigint[],
            %(provider_failures)s::bigint[], %(concurrency_failures)s::bigint[])
     AS batch(t, l, d, df, pa, pf, cf)
ON CONFLICT (task_name, limiter) DO UPDATE SET
    deliveries = c.deliveries + EXCLUDED.deliveries,
    deferrals = c.deferrals + EXCLUDED.deferrals,
    provider_attempts = c.provider_attempts + EXCLUDED.provider_attempts,
    provider_failures = c.provider_failures + EXCLUDED.provider_failures,
    concurrency_failures = c.concurrency_failures + EXCLUDED.concurrency_failures,
    updated_at = clock_timestamp()
RETURNING 1
"""

ADMISSION_COUNTS: LiteralString = """
SELECT task_name, limiter, deliveries, deferrals, provider_attempts, provider_failures,
       concurrency_failures
FROM runcell_admission_counter ORDER BY task_name, limiter
"""

ADD_REVOKED: LiteralString = """
INSERT INTO runcell_revoked (run_id) SELECT unnest(%(run_ids)s::text[])
ON CONFLICT (run_id) DO NOTHING
RETURNING run_id
"""

REVOKED_AMONG: LiteralString = """
SELECT run_id FROM runcell_revoked WHERE run_id = ANY(%(run_ids)s::text[])
"""

PURGE_REVOKED: LiteralString = """
DELETE FROM runcell_revoked
WHERE revoked_at < clock_timestamp() - %(keep_ms)s * interval '1 millisecond'
RETURNING run_id
"""

STATS: LiteralString = """
SELECT 'active' AS kind, workload, count(*) FROM runcell_lease
WHERE limiter = %(limiter)s AND expires_at > clock_timestamp()
GROUP BY workload
UNION ALL
SELECT 'queued', workload, count(*) FROM runcell_queue
WHERE limiter = %(limiter)s AND expires_at > clock_timestamp() AND granted_lease_id IS NULL
GROUP BY workload
"""

#: Expire leases now (force release), so the next allocation pass reaps them like a
#: crashed holder's (a parked task's grant goes back in line) and renewals fail.
EXPIRE_LEASES: LiteralString = """
UPDATE runcell_lease SET expires_at = clock_timestamp()
WHERE lease_id = ANY(%(lease_ids)s::uuid[]) AND expires_at > clock_timestamp()
RETURNING lease_id::text, limiter, workload, request_id, fencing_token, run_id, root_run_id,
          parent_run_id, holder_name
"""

#: The limits stored for every limiter (or the named ones).
STORED_LIMITS: LiteralString = """
SELECT name, config FROM runcell_limiter
WHERE %(names)s::text[] IS NULL OR name = ANY(%(names)s::text[])
ORDER BY name
"""

#: Per limiter: its configured workloads, slots held and requests queued (waiting or
#: parked, not granted) per workload, and how long the oldest of those has waited.
#: The counts are those of ``STATS`` (the limiter's own view), for every limiter at once.
LIMITER_STATES: LiteralString = """
SELECT l.name,
       (SELECT coalesce(jsonb_agg(w ORDER BY w), '[]'::jsonb)
        FROM jsonb_object_keys(l.config -> 'workloads') AS w),
       (SELECT coalesce(jsonb_object_agg(held.workload, held.n), '{}'::jsonb)
        FROM (SELECT workload, count(*) AS n FROM runcell_lease AS a
              WHERE a.limiter = l.name AND a.expires_at > clock_timestamp()
              GROUP BY workload) AS held),
       (SELECT coalesce(jsonb_object_agg(waiting.workload, waiting.n), '{}'::jsonb)
        FROM (SELECT workload, count(*) AS n FROM runcell_queue AS q
              WHERE q.limiter = l.name AND q.granted_lease_id IS NULL
                AND q.expires_at > clock_timestamp()
              GROUP BY workload) AS waiting),
       (SELECT extract(epoch FROM clock_timestamp() - min(q.enqueued_at)) * 1000
        FROM runcell_queue AS q
        WHERE q.limiter = l.name AND q.granted_lease_id IS NULL
          AND q.expires_at > clock_timestamp())::float8
FROM runcell_limiter AS l
WHERE %(names)s::text[] IS NULL OR l.name = ANY(%(names)s::text[])
ORDER BY l.name
"""

NOTIFY_SELF_CHECK: LiteralString = "SELECT pg_notify('runcell_grant', %(payload)s)"

LISTEN: LiteralString = "LISTEN runcell_grant"
