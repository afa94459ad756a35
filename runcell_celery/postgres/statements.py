"""Every SQL statement the PostgreSQL limiter sends, named after what it does.

The allocation logic under the limiter row's lock lives in ``schema.sql`` as
PL/pgSQL functions (one round trip each); these statements call them. Parameters are
always bound (``%(name)s``), never formatted into the text.
"""

from __future__ import annotations

from typing import LiteralString

#: Read from the catalog with an ordinary (MVCC) snapshot, not the relation cache:
#: after waiting for the schema lock, a worker must see the tables another worker
#: just created (``to_regclass`` could answer from a stale cache entry).
SCHEMA_EXISTS: LiteralString = """
SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_tables
               WHERE tablename = 'runcell_schema' AND schemaname = ANY(current_schemas(false)))
"""

#: The schema version the database records (``runcell_schema``; NULL: none recorded).
SCHEMA_VERSION_RECORDED: LiteralString = "SELECT max(version) FROM runcell_schema"

#: Serialises schema creation between workers that start at the same moment.
LOCK_SCHEMA: LiteralString = "SELECT pg_advisory_xact_lock(%(key)s)"

#: Bounds for the few transactions of several round trips (registration): a worker
#: frozen between them loses its transaction instead of holding rows.
TRANSACTION_BOUNDS: LiteralString = (
    "SET LOCAL idle_in_transaction_session_timeout = 5000; "
    "SET LOCAL lock_timeout = 5000; SET LOCAL statement_timeout = 60000"
)

REGISTER_LIMITER: LiteralString = """
INSERT INTO runcell_limiter (name, config, config_hash)
VALUES (%(name)s, %(config)s, %(config_hash)s)
ON CONFLICT (name) DO NOTHING
RETURNING name
"""

STORED_LIMITER: LiteralString = """
SELECT config, config_hash FROM runcell_limiter WHERE name = %(name)s FOR UPDATE
"""

#: The stored limits without locking the row (a worker adopting them, ``use_stored``).
READ_STORED_LIMITER: LiteralString = """
SELECT config, config_hash FROM runcell_limiter WHERE name = %(name)s
"""

REPLACE_LIMITER: LiteralString = """
UPDATE runcell_limiter
SET config = %(config)s, config_hash = %(config_hash)s, updated_at = clock_timestamp()
WHERE name = %(name)s
"""

# Every operation is one call of a function of ``schema.sql`` (one round trip, one
# transaction) over the request's limiters in lock (name) order, sent as one
# simple-query message behind ``SET LOCAL`` bounds on the statement and the lock wait
# (:func:`runcell_celery.postgres.calls.call`). ``op_id`` (a client-made UUID, or NULL)
# makes a retry after a lost reply get the first attempt's answer (``runcell_operation``).

ACQUIRE: LiteralString = """
SELECT runcell_acquire(%(limiters)s::text[], %(hashes)s::text[], %(workloads)s::text[],
    %(request)s::jsonb, %(wait_ms)s, %(process)s::jsonb, %(lock_timeout_ms)s, %(retry)s)
"""

#: :data:`ACQUIRE` also saying where the request joins each line (sent instead only for
#: a request over several limiters when a tracer records the wait's place): ``"lines"``,
#: one ``[ahead, hold_ms, slots]`` per limiter, read with the statement's snapshot.
ACQUIRE_WITH_LINES: LiteralString = (
    ACQUIRE
    + """    || jsonb_build_object('lines', (
        SELECT jsonb_agg(jsonb_build_array(
                   l.waiting[array_position(l.workloads, u.workload)],
                   l.hold_ms_avg,
                   least(l.ceilings[array_position(l.workloads, u.workload)],
                         l.max_concurrent))
               ORDER BY u.o)
        FROM unnest(%(limiters)s::text[], %(workloads)s::text[])
             WITH ORDINALITY AS u(name, workload, o)
        JOIN runcell_limiter AS l ON l.name = u.name))
"""
)

RELEASE: LiteralString = """
SELECT runcell_release(%(limiter)s, %(lease_id)s::uuid, %(lock_timeout_ms)s)
"""

WITHDRAW: LiteralString = """
SELECT runcell_withdraw(%(limiters)s::text[], %(request_id)s, %(give_back)s,
    %(op_id)s::uuid, %(lock_timeout_ms)s)
"""

PARK: LiteralString = """
SELECT runcell_park(%(limiters)s::text[], %(request_id)s, %(payload)s::jsonb,
    %(op_id)s::uuid, %(lock_timeout_ms)s, %(broker)s)
"""

#: A re-published parked task takes its delivery's leases (its publication only).
CLAIM_PARKED: LiteralString = """
SELECT runcell_claim(%(limiters)s::text[], %(request_id)s, %(publication_id)s::uuid,
    %(op_id)s::uuid)
"""

#: The group pass of a request over several limiters (``runcell_grant_request``).
ALLOCATE_GROUP: LiteralString = """
SELECT runcell_grant_request(%(group_id)s, %(lock_timeout_ms)s)
"""

REAP: LiteralString = "SELECT runcell_reap(%(limiter)s, %(lock_timeout_ms)s)"

#: One process's safety poll for all its waiters (see ``runcell_poll``).
POLL: LiteralString = """
SELECT runcell_poll(%(process)s::jsonb, %(request_ids)s::text[], %(limiters)s::text[],
                       %(heartbeat)s)
"""

#: Renew every lease a process holds on one limiter in one statement.
RENEW: LiteralString = """
SELECT runcell_renew(%(limiter)s, %(lease_ids)s::uuid[])
"""

#: After storing or replacing limits: their array form and the counts, from the rows.
SET_LIMITS: LiteralString = "SELECT runcell_set_limits(%(name)s)"

#: After replacing limits, in the same transaction: an allocation pass on the limiter
#: and each of its keys with waiters, in lock order (answers like a release).
ALLOCATE_AFTER_NEW_LIMITS: LiteralString = """
SELECT runcell_due_groups(jsonb_build_object('parked', coalesce(jsonb_agg(p.lease), '[]')))
FROM (SELECT l.name FROM runcell_limiter AS l
      WHERE (l.name = %(name)s OR l.parent = %(name)s) AND 0 < ANY(l.waiting)
      ORDER BY l.name COLLATE "C") AS changed,
     LATERAL runcell_reap(changed.name, %(lock_timeout_ms)s) AS r(parked),
     LATERAL jsonb_array_elements(r.parked) AS p(lease)
"""

#: Take the right to re-publish grants once each: those just granted and any unpublished
#: past ``stale_ms``, parked for ``broker`` (or none); other brokers due come as rows
#: with only the last column set.
CLAIM_REPUBLISH: LiteralString = """
WITH claimed AS (
    UPDATE runcell_queue
    SET published_at = clock_timestamp(), publication_id = gen_random_uuid()
    WHERE granted_lease_id IS NOT NULL AND published_at IS NULL
      AND (granted_lease_id = ANY(%(lease_ids)s::uuid[])
           OR granted_at < clock_timestamp() - %(stale_ms)s * interval '1 millisecond')
      AND (broker IS NULL OR broker = %(broker)s::text)
    RETURNING limiter, request_id, publication_id::text, payload::text
)
SELECT limiter, request_id, publication_id, payload, NULL::text FROM claimed
UNION ALL
SELECT DISTINCT NULL, NULL, NULL, NULL, broker FROM runcell_queue
WHERE granted_lease_id IS NOT NULL AND published_at IS NULL
  AND (granted_lease_id = ANY(%(lease_ids)s::uuid[])
       OR granted_at < clock_timestamp() - %(stale_ms)s * interval '1 millisecond')
  AND broker IS DISTINCT FROM %(broker)s::text AND broker IS NOT NULL
"""

#: Give back the right to publish grants whose publication failed (the next sweep takes
#: them again); a row claimed or granted again meanwhile is left alone.
UNCLAIM_REPUBLISH: LiteralString = """
UPDATE runcell_queue AS q
SET published_at = NULL
FROM unnest(%(limiters)s::text[], %(request_ids)s::text[], %(publication_ids)s::uuid[])
     AS f(limiter, request_id, publication_id)
WHERE q.limiter = f.limiter AND q.request_id = f.request_id
  AND q.publication_id = f.publication_id AND q.granted_lease_id IS NOT NULL
RETURNING q.request_id
"""

#: Parked requests past their deadline, phase one: taken out of line and handed to
#: ``taker``, stored until ``COMPLETE_EXPIRED``; also purges old operation records.
TAKE_EXPIRED_PARKED: LiteralString = """
SELECT limiter, request_id, workload, run_id, root_run_id, parent_run_id, holder_name,
       payload::text, (extract(epoch FROM expired_at - enqueued_at) * 1000)::float8
FROM runcell_take_expired_parked(%(taker)s, %(retake_after_ms)s, %(keep_ops_ms)s,
                                    %(lock_timeout_ms)s, %(broker)s)
"""

#: Phase two: delete expired parked requests whose failure is recorded.
COMPLETE_EXPIRED: LiteralString = """
SELECT runcell_complete_expired(%(items)s::jsonb, %(op_id)s::uuid)
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

#: Add a batch of counts in one statement; a batch with an id is added once.
ADD_ADMISSION_COUNTS: LiteralString = """
WITH op AS (
    INSERT INTO runcell_operation (op_id)
    SELECT %(batch_id)s::uuid WHERE %(batch_id)s::uuid IS NOT NULL
    ON CONFLICT (op_id) DO NOTHING
    RETURNING op_id
)
INSERT INTO runcell_admission_counter AS c (task_name, limiter, deliveries, deferrals,
    provider_attempts, provider_failures, concurrency_failures, updated_at)
SELECT t, l, d, df, pa, pf, cf, clock_timestamp()
FROM unnest(%(task_names)s::text[], %(limiters)s::text[], %(deliveries)s::bigint[],
            %(deferrals)s::bigint[], %(provider_attempts)s::bigint[],
            %(provider_failures)s::bigint[], %(concurrency_failures)s::bigint[])
     AS batch(t, l, d, df, pa, pf, cf)
WHERE %(batch_id)s::uuid IS NULL OR EXISTS (SELECT 1 FROM op)
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

#: The kept counts: slots held and requests waiting (or parked, not granted) per
#: workload, as allocation sees them (one row, no count(*)).
STATS: LiteralString = """
SELECT workloads, active, waiting FROM runcell_limiter WHERE name = %(limiter)s
"""

#: An operator's force release: expire the leases (the next pass reaps them) and note
#: who did it where the holder looks when its renewal fails.
_EXPIRE_LEASES: LiteralString = """
WITH expired AS (
    UPDATE runcell_lease SET expires_at = clock_timestamp()
    WHERE lease_id = ANY(%(lease_ids)s::uuid[]) AND expires_at > clock_timestamp()
    RETURNING lease_id, limiter, workload, request_id, fencing_token, run_id, root_run_id,
              parent_run_id, holder_name
), noted AS (
    INSERT INTO runcell_operation (op_id, result)
    SELECT lease_id, jsonb_build_object('force_released_by', %(actor)s::text) FROM expired
    WHERE %(actor)s::text IS NOT NULL
    ON CONFLICT (op_id) DO NOTHING
)
"""

_RELEASED: LiteralString = """
SELECT lease_id::text, limiter, workload, request_id, fencing_token, run_id, root_run_id,
       parent_run_id, holder_name
FROM expired
"""

EXPIRE_LEASES: LiteralString = _EXPIRE_LEASES + _RELEASED

#: :data:`EXPIRE_LEASES`, and a ``force-released`` event per lease in ``runcell_event``
#: (the table runcell_django's migrations create; its columns are all nullable but
#: these), in the same statement: the audit record commits with the release.
EXPIRE_LEASES_RECORDED: LiteralString = (
    _EXPIRE_LEASES
    + """, recorded AS (
    INSERT INTO runcell_event (type, occurred_at, limiter, workload, run_id, root_run_id,
                               parent_run_id, request_id, holder_name, lease_id,
                               fencing_token, host, pid, actor)
    SELECT 'force-released', clock_timestamp(), left(limiter, 200), left(workload, 200),
           left(run_id, 255), left(root_run_id, 255), left(parent_run_id, 255),
           left(request_id, 255), left(holder_name, 255), lease_id::text, fencing_token,
           left(%(host)s::text, 255), %(pid)s::integer, left(%(actor)s::text, 150)
    FROM expired
)
"""
    + _RELEASED
)

#: Who force-released a lease, if an operator did (see ``EXPIRE_LEASES``).
FORCE_RELEASED_BY: LiteralString = """
SELECT result->>'force_released_by' FROM runcell_operation WHERE op_id = %(lease_id)s::uuid
"""

#: The limits stored for every limiter (or the named ones).
STORED_LIMITS: LiteralString = """
SELECT name, config FROM runcell_limiter
WHERE %(names)s::text[] IS NULL OR name = ANY(%(names)s::text[])
ORDER BY name
"""

#: Per limiter: workloads, slots held and requests queued per workload, oldest wait.
LIMITER_STATES: LiteralString = """
SELECT l.name, l.workloads, l.active, l.waiting,
       (SELECT extract(epoch FROM clock_timestamp() - min(q.enqueued_at)) * 1000
        FROM runcell_queue AS q
        WHERE q.limiter = l.name AND q.granted_lease_id IS NULL
          AND q.expired_at IS NULL)::float8
FROM runcell_limiter AS l
WHERE %(names)s::text[] IS NULL OR l.name = ANY(%(names)s::text[])
ORDER BY l.name
"""

#: Grants to parked requests are announced on this channel to every re-publisher;
#: waiting processes each listen on a channel of their own.
PARKED_CHANNEL = "runcell_parked"

NOTIFY_SELF_CHECK: LiteralString = "SELECT pg_notify(%(channel)s, %(payload)s)"

#: Delete idle keys of a keyed limiter (``runcell_purge_idle_keys``).
PURGE_IDLE_KEYS: LiteralString = """
SELECT runcell_purge_idle_keys(%(parent)s, %(limit)s)
"""

#: A keyed limiter's limits were stored again: its keys take them
#: (``runcell_sync_keys``).
SYNC_KEYS: LiteralString = """
SELECT runcell_sync_keys(%(name)s)
"""

#: The busiest keys of a keyed limiter in use, at most ``limit``, optionally those
#: containing ``search`` (any case).
KEY_STATS: LiteralString = """
SELECT k.name, h.held, q.queued
FROM runcell_limiter AS k,
     LATERAL (SELECT coalesce(sum(a), 0) FROM unnest(k.active) AS a) AS h(held),
     LATERAL (SELECT coalesce(sum(w), 0) FROM unnest(k.waiting) AS w) AS q(queued)
WHERE k.parent = %(parent)s AND (h.held > 0 OR q.queued > 0)
  AND (%(search)s::text IS NULL
       OR strpos(lower(substr(k.name, length(%(parent)s) + 2)), lower(%(search)s::text)) > 0)
ORDER BY h.held DESC, q.queued DESC, k.name
LIMIT %(limit)s
"""

#: How many keys of a keyed limiter hold a slot or have a request waiting.
KEYS_IN_USE: LiteralString = """
SELECT count(*) FROM runcell_limiter AS k
WHERE k.parent = %(parent)s AND (0 < ANY(k.active) OR 0 < ANY(k.waiting))
"""

#: Slots held and requests waiting per workload, summed over every key of a keyed
#: limiter.
KEYED_TOTALS: LiteralString = """
SELECT k.workloads[i], sum(k.active[i]), sum(k.waiting[i])
FROM runcell_limiter AS k, generate_subscripts(k.workloads, 1) AS i
WHERE k.parent = %(parent)s
GROUP BY k.workloads[i]
"""

#: Whether ``name`` is a keyed limiter's stored name (its keys' names start with it).
IS_KEYED: LiteralString = """
SELECT 1 FROM runcell_limiter
WHERE name = %(name)s AND parent IS NULL AND coalesce((config->>'keyed')::boolean, false)
"""

#: A limiter that is not a key but is named like a key of ``name`` (``"tenant:acme"``
#: beside a keyed ``"tenant"``): both would be one row. Compared byte-wise, as names are.
PLAIN_NAMED_LIKE_A_KEY: LiteralString = """
SELECT name FROM runcell_limiter
WHERE parent IS NULL AND starts_with(name COLLATE "C", %(name)s || ':')
ORDER BY name COLLATE "C" LIMIT 1
"""

#: The keys of a keyed limiter holding an expired lease. Leases are few (one per slot
#: held fleet-wide), so they are read whole rather than through 100,000 key rows.
KEYS_WITH_EXPIRED_LEASES: LiteralString = """
SELECT DISTINCT l.limiter FROM runcell_lease AS l
WHERE l.expires_at <= clock_timestamp()
  AND left(l.limiter, length(%(parent)s) + 1) = %(parent)s || ':'
"""

#: Parked requests over several limiters due a group pass: no process waits for them,
#: so the sweepers run their passes, heads of line first.
PARKED_GROUPS: LiteralString = """
SELECT group_id FROM runcell_queue
WHERE parked AND group_id IS NOT NULL AND granted_lease_id IS NULL
ORDER BY position
LIMIT %(limit)s
"""

#: Forget the round-robin history of keys idle for ``idle_ms`` (nothing waiting, not
#: served since): ``runcell_purge_fair_history``.
PURGE_FAIR_HISTORY: LiteralString = """
SELECT runcell_purge_fair_history(%(idle_ms)s, %(limit)s)
"""


# -- Operators' commands (runcell_celery.postgres.operations) -------------------------

#: Which of the named tables this database has (on the search path), read from the
#: catalog: the limiter's (``runcell_limiter``) and runcell_django's (``runcell_event``,
#: ``runcell_occupancy``), which a database without Django lacks.
TABLES_PRESENT: LiteralString = """
SELECT tablename::text FROM pg_catalog.pg_tables
WHERE tablename = ANY(%(names)s::text[]) AND schemaname = ANY(current_schemas(false))
"""

#: The limits of every limiter that is not a key of a keyed limiter, by name.
LIMITERS_NOT_KEYS: LiteralString = """
SELECT name, config, workloads, reserved, priorities, max_queued FROM runcell_limiter
WHERE parent IS NULL
ORDER BY name
"""

#: The 95th percentile of the waits of the slots each named limiter granted in the
#: last ``minutes`` (the ``acquired`` events runcell_django records).
P95_WAITS: LiteralString = """
SELECT limiter, percentile_cont(0.95) WITHIN GROUP (ORDER BY wait_ms)
FROM runcell_event
WHERE limiter = ANY(%(names)s::text[]) AND type = 'acquired'
  AND occurred_at > clock_timestamp() - %(minutes)s * interval '1 minute'
GROUP BY limiter
"""

#: The leases held now among ``lease_ids``, or by the runs ``run_ids`` (a force release
#: checks what it was asked to release before it releases anything).
HELD_LEASES: LiteralString = """
SELECT lease_id::text, limiter, workload, run_id, holder_name, holder_host, holder_pid,
       fencing_token
FROM runcell_lease
WHERE (lease_id = ANY(%(lease_ids)s::uuid[]) OR run_id = ANY(%(run_ids)s::text[]))
  AND expires_at > clock_timestamp()
ORDER BY limiter, acquired_at
"""

#: The moment ``older_than_ms`` ago in database time: one cutoff for a whole purge.
CUTOFF: LiteralString = """
SELECT clock_timestamp() - %(older_than_ms)s * interval '1 millisecond'
"""

#: Delete at most ``limit`` events older than ``before`` (``runcell_event_for_list``);
#: a purge repeats it, so no transaction is long.
PURGE_EVENTS: LiteralString = """
WITH gone AS (
    DELETE FROM runcell_event WHERE id IN (
        SELECT id FROM runcell_event WHERE occurred_at < %(before)s LIMIT %(limit)s
    )
    RETURNING 1
)
SELECT count(*) FROM gone
"""

#: Delete at most ``limit`` occupancy samples older than ``before``
#: (``runcell_occupancy_for_chart``).
PURGE_OCCUPANCY: LiteralString = """
WITH gone AS (
    DELETE FROM runcell_occupancy WHERE id IN (
        SELECT id FROM runcell_occupancy WHERE sampled_at < %(before)s LIMIT %(limit)s
    )
    RETURNING 1
)
SELECT count(*) FROM gone
"""
