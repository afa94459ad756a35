"""The limiter's DDL as runcell_celery shipped it with the PostgresBackend port.

``postgres_concurrency_schema_sql()`` at checksum ``6406a588ed53b470``, frozen as text
like 0001's: one JSON shape for a lease (``runcell_lease_json``) and the allocation
functions at version 2 (``runcell_lock_v2``, ``runcell_apply_v2``), which answer with
durations instead of instants. It is idempotent; the version 1 functions stay for
workers still running the previous release until they are upgraded.
"""

from django.db import migrations

#: ``runcell_celery.postgres.postgres_concurrency_schema_sql()``, checksum 6406a588ed53b470.
LIMITER_SCHEMA = r"""
-- runcell_celery PostgreSQL limiter schema, version 1.
--
-- Applied on first use (under an advisory lock, so workers starting together on a
-- new database do not conflict), or as a migration with ensure_schema=False: it is
-- idempotent. One row per limiter (its stored limits and fencing counter), one row
-- per held slot (a lease: who holds it and until when), one row per waiting request.
-- Every time is database time (clock_timestamp(), never the workers' clocks).

-- One row per applied revision of this file (its checksum), so that a worker with a
-- newer file re-applies it (functions are replaced; tables only ever gain objects).
CREATE TABLE IF NOT EXISTS runcell_schema (
    checksum text PRIMARY KEY,
    version integer NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- The limits every worker using this name must share, and the lock that
-- serialises allocation: each allocation is one short transaction that holds this
-- row FOR UPDATE.
CREATE TABLE IF NOT EXISTS runcell_limiter (
    name text PRIMARY KEY,
    config jsonb NOT NULL,
    config_hash text NOT NULL,
    last_fencing_token bigint NOT NULL DEFAULT 0,
    created_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    updated_at timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- One row per held slot. A holder that crashes stops renewing; its row is reaped
-- once expires_at passes, which gives the slot back.
CREATE TABLE IF NOT EXISTS runcell_lease (
    lease_id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    limiter text NOT NULL,
    workload text NOT NULL,
    request_id text NOT NULL,
    fencing_token bigint NOT NULL,
    run_id text,
    root_run_id text,
    parent_run_id text,
    holder_name text,
    holder_host text,
    holder_pid integer,
    ttl_ms integer NOT NULL,
    acquired_at timestamptz NOT NULL,
    renewed_at timestamptz NOT NULL,
    expires_at timestamptz NOT NULL,
    -- A lease granted to a parked request (Celery admission deferral) is held for
    -- its task until the re-published task starts again and picks it up.
    parked boolean NOT NULL DEFAULT false,
    picked_up_at timestamptz,
    CONSTRAINT runcell_lease_one_per_request UNIQUE (request_id)
);
CREATE INDEX IF NOT EXISTS runcell_lease_for_reap ON runcell_lease (limiter, expires_at);
CREATE INDEX IF NOT EXISTS runcell_lease_for_counts ON runcell_lease (limiter, workload);

-- One row per waiting request, in arrival order (position). A waiter refreshes
-- expires_at while it polls; a crashed waiter's row is reaped after queue_entry_ttl_ms.
-- Parked rows (Celery admission deferral) carry the task message to re-publish.
CREATE SEQUENCE IF NOT EXISTS runcell_queue_position;
CREATE TABLE IF NOT EXISTS runcell_queue (
    request_id text PRIMARY KEY,
    limiter text NOT NULL,
    workload text NOT NULL,
    position bigint NOT NULL DEFAULT nextval('runcell_queue_position'),
    run_id text,
    root_run_id text,
    parent_run_id text,
    holder_name text,
    holder_host text,
    holder_pid integer,
    enqueued_at timestamptz NOT NULL,
    deadline timestamptz,
    expires_at timestamptz NOT NULL,
    -- The request's run already took a slot: served before new runs of its workload.
    in_progress boolean NOT NULL DEFAULT false,
    -- Parked (Celery admission deferral): no waiter polls the row; it carries the
    -- task message. When granted it keeps its place until its task picks the lease
    -- up: if the lease expires first, the row is simply back in line.
    parked boolean NOT NULL DEFAULT false,
    payload jsonb,
    granted_lease_id uuid,
    granted_at timestamptz,
    published_at timestamptz,
    publication_id uuid
);
CREATE INDEX IF NOT EXISTS runcell_queue_for_allocation ON runcell_queue (limiter, workload, position);
CREATE INDEX IF NOT EXISTS runcell_queue_for_reap ON runcell_queue (limiter, expires_at);
CREATE INDEX IF NOT EXISTS runcell_queue_for_expiry_of_parked ON runcell_queue (deadline)
    WHERE parked;
CREATE INDEX IF NOT EXISTS runcell_queue_for_republish ON runcell_queue (granted_at)
    WHERE granted_lease_id IS NOT NULL AND published_at IS NULL;

-- When each run first started, so a run's time budget survives redelivery and
-- deferral (a Celery task's timeout_ms counts from its first start).
CREATE TABLE IF NOT EXISTS runcell_run (
    run_id text PRIMARY KEY,
    first_started_at timestamptz NOT NULL,
    deadline timestamptz
);
CREATE INDEX IF NOT EXISTS runcell_run_for_purge ON runcell_run (first_started_at);

-- Runs revoked in Celery (copied from the workers' revoked sets), so that the
-- children of a revoked root stop waiting on every worker, not only on one.
CREATE TABLE IF NOT EXISTS runcell_revoked (
    run_id text PRIMARY KEY,
    revoked_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX IF NOT EXISTS runcell_revoked_for_purge ON runcell_revoked (revoked_at);

-- Admission counters per task name and limiter, summed over every worker: a
-- deferral is counted apart from a failure.
CREATE TABLE IF NOT EXISTS runcell_admission_counter (
    task_name text NOT NULL,
    limiter text NOT NULL,
    deliveries bigint NOT NULL DEFAULT 0,
    deferrals bigint NOT NULL DEFAULT 0,
    provider_attempts bigint NOT NULL DEFAULT 0,
    provider_failures bigint NOT NULL DEFAULT 0,
    concurrency_failures bigint NOT NULL DEFAULT 0,
    updated_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (task_name, limiter)
);

-- Upgrades: a database created by an earlier revision of this file has the tables but
-- not every column. CREATE TABLE IF NOT EXISTS leaves an existing table as it is, so
-- each column added since is added here too (a no-op on a new database). Functions
-- below are replaced whole.
ALTER TABLE runcell_schema ADD COLUMN IF NOT EXISTS checksum text;
ALTER TABLE runcell_lease ADD COLUMN IF NOT EXISTS parked boolean NOT NULL DEFAULT false;
ALTER TABLE runcell_lease ADD COLUMN IF NOT EXISTS picked_up_at timestamptz;
ALTER TABLE runcell_queue ADD COLUMN IF NOT EXISTS in_progress boolean NOT NULL DEFAULT false;
ALTER TABLE runcell_queue ADD COLUMN IF NOT EXISTS parked boolean NOT NULL DEFAULT false;
ALTER TABLE runcell_queue ADD COLUMN IF NOT EXISTS payload jsonb;
ALTER TABLE runcell_queue ADD COLUMN IF NOT EXISTS granted_lease_id uuid;
ALTER TABLE runcell_queue ADD COLUMN IF NOT EXISTS granted_at timestamptz;
ALTER TABLE runcell_queue ADD COLUMN IF NOT EXISTS published_at timestamptz;
ALTER TABLE runcell_queue ADD COLUMN IF NOT EXISTS publication_id uuid;

-- A lease as the limiter reads it back: {lease_id, request_id, workload, fencing_token}.
-- Every function that answers with a lease builds it here.
CREATE OR REPLACE FUNCTION runcell_lease_json(p_lease runcell_lease) RETURNS jsonb
LANGUAGE sql IMMUTABLE AS $$
    SELECT jsonb_build_object('lease_id', p_lease.lease_id, 'request_id', p_lease.request_id,
                              'workload', p_lease.workload,
                              'fencing_token', p_lease.fencing_token)
$$;

-- Lock the limiter row, apply a release or a withdrawal, reap what expired, and
-- return what allocation needs. A PL/pgSQL function so that every statement after
-- the lock reads a fresh snapshot (under READ COMMITTED a single statement would
-- read rows as of before it waited for the lock) and all of it is one round trip.
--
-- Returns: {"config_hash", "active": {workload: n}, "queued": n,
--           "waiting": [[request_id, workload, position, in_progress], ...] oldest
--           first: the first max_per_workload of each workload in the order allocation
--           serves it (runs in progress first), as no more can be granted at once,
--           "mine": the lease or queue row p_request_id already has, or null:
--           {"lease": {...}} | {"parked_lease": id} | {"queued": ms left to wait or null}}.
-- "mine" makes a retried acquire idempotent: if the first attempt committed but its
-- answer was lost with the connection, the retry finds what it already got.
-- Returns NULL if the limiter row does not exist.
CREATE OR REPLACE FUNCTION runcell_lock_v2(
    p_limiter text,
    p_release_lease uuid,
    p_withdraw_request text,
    p_request_id text,
    p_max_per_workload integer
) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
    v_hash text;
    v_active jsonb;
    v_waiting jsonb;
    v_queued integer;
    v_mine jsonb;
BEGIN
    SELECT config_hash INTO v_hash FROM runcell_limiter WHERE name = p_limiter FOR UPDATE;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    IF p_release_lease IS NOT NULL THEN
        DELETE FROM runcell_lease WHERE lease_id = p_release_lease AND limiter = p_limiter;
    END IF;
    IF p_withdraw_request IS NOT NULL THEN
        DELETE FROM runcell_queue WHERE request_id = p_withdraw_request AND limiter = p_limiter;
        -- A slot granted at the moment of the cancel is given back.
        DELETE FROM runcell_lease WHERE request_id = p_withdraw_request AND limiter = p_limiter;
    END IF;
    WITH expired AS (
        DELETE FROM runcell_lease WHERE limiter = p_limiter AND expires_at <= clock_timestamp()
        RETURNING lease_id
    )
    -- A parked grant whose task never picked it up is back in line, in its place.
    UPDATE runcell_queue q
    SET granted_lease_id = NULL, granted_at = NULL, published_at = NULL, publication_id = NULL
    FROM expired WHERE q.granted_lease_id = expired.lease_id;
    -- Parked rows have no waiter to refresh them; the sweeper handles their deadline.
    DELETE FROM runcell_queue
    WHERE limiter = p_limiter AND expires_at <= clock_timestamp() AND NOT parked;

    SELECT coalesce(jsonb_object_agg(workload, n), '{}'::jsonb) INTO v_active
    FROM (SELECT workload, count(*) AS n FROM runcell_lease
          WHERE limiter = p_limiter GROUP BY workload) AS held;

    SELECT count(*) INTO v_queued FROM runcell_queue
    WHERE limiter = p_limiter AND granted_lease_id IS NULL;

    SELECT coalesce(jsonb_agg(jsonb_build_array(request_id, workload, position, in_progress)
                              ORDER BY position),
                    '[]'::jsonb)
    INTO v_waiting
    FROM (SELECT request_id, workload, position, in_progress,
                 row_number() OVER (PARTITION BY workload
                                    ORDER BY in_progress DESC, position) AS nth
          FROM runcell_queue
          -- Stale work is dropped before it takes a slot: a request past its
          -- deadline is never granted (its waiter or the sweeper removes it).
          WHERE limiter = p_limiter AND granted_lease_id IS NULL
            AND (deadline IS NULL OR deadline > clock_timestamp())) AS ranked
    WHERE nth <= p_max_per_workload;

    IF p_request_id IS NOT NULL THEN
        -- A lease granted to this request while it was parked belongs to the task's
        -- re-published message, never to another delivery: report it as such.
        SELECT CASE WHEN l.parked THEN jsonb_build_object('parked_lease', l.lease_id)
                    ELSE jsonb_build_object('lease', runcell_lease_json(l)) END
        INTO v_mine FROM runcell_lease AS l
        WHERE l.request_id = p_request_id AND l.limiter = p_limiter;
        IF NOT FOUND THEN
            -- A duration, never an instant: the worker's clock may differ from ours.
            SELECT jsonb_build_object('queued',
                       extract(epoch FROM deadline - clock_timestamp()) * 1000)
            INTO v_mine FROM runcell_queue
            WHERE request_id = p_request_id AND limiter = p_limiter;
        END IF;
    END IF;

    RETURN jsonb_build_object(
        'config_hash', v_hash, 'active', v_active, 'queued', v_queued, 'waiting', v_waiting,
        'mine', v_mine
    );
END;
$$;

-- Apply an allocation decided by runcell_celery.allocation.allocate() while the
-- limiter row is still locked (same transaction as runcell_lock_v2):
--   p_grants:  [request_id, ...] waiting requests to grant, in grant order;
--   p_caller:  the calling request as {request_id, workload, run_id, ...} or NULL;
--   p_caller_action: 'grant' (a lease now), 'enqueue' (wait) or NULL.
-- Grants get fencing tokens in order, their queue rows go, and the processes that
-- wait for them are told on channel runcell_grant (only when someone was granted:
-- NOTIFY takes a cluster-wide lock at commit). Returns the new leases as
-- [{lease_id, request_id, workload, fencing_token, parked}] and how long the caller
-- may wait in the queue (wait_ms_left; a duration, so no host clock is involved).
CREATE OR REPLACE FUNCTION runcell_apply_v2(
    p_limiter text,
    p_grants jsonb,
    p_caller jsonb,
    p_caller_action text,
    p_ttl_ms integer,
    p_queue_ttl_ms integer
) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := clock_timestamp();
    v_count integer := jsonb_array_length(p_grants)
                       + CASE WHEN p_caller_action = 'grant' THEN 1 ELSE 0 END;
    v_first bigint;
    v_leases jsonb := '[]'::jsonb;
    v_deadline timestamptz;
    v_notify text;
BEGIN
    IF v_count > 0 THEN
        UPDATE runcell_limiter SET last_fencing_token = last_fencing_token + v_count
        WHERE name = p_limiter
        RETURNING last_fencing_token - v_count + 1 INTO v_first;
    END IF;

    IF jsonb_array_length(p_grants) > 0 THEN
        WITH granted AS (
            SELECT q.*, g.ord
            FROM jsonb_array_elements_text(p_grants) WITH ORDINALITY AS g(request_id, ord)
            JOIN runcell_queue q ON q.request_id = g.request_id AND q.limiter = p_limiter
        ), inserted AS (
            INSERT INTO runcell_lease (limiter, workload, request_id, fencing_token, run_id,
                root_run_id, parent_run_id, holder_name, holder_host, holder_pid, ttl_ms,
                acquired_at, renewed_at, expires_at, parked)
            SELECT p_limiter, granted.workload, granted.request_id, v_first + granted.ord - 1,
                granted.run_id, granted.root_run_id, granted.parent_run_id, granted.holder_name,
                granted.holder_host, granted.holder_pid, p_ttl_ms, v_now, v_now,
                v_now + p_ttl_ms * interval '1 millisecond', granted.parked
            FROM granted
            RETURNING lease_id, request_id, workload, fencing_token, parked
        ), waiting_gone AS (
            DELETE FROM runcell_queue q USING inserted
            WHERE q.request_id = inserted.request_id AND NOT inserted.parked
        ), parked_granted AS (
            UPDATE runcell_queue q SET granted_lease_id = inserted.lease_id, granted_at = v_now
            FROM inserted WHERE q.request_id = inserted.request_id AND inserted.parked
        )
        -- A parked grant is announced as "!request_id": its task must be re-published.
        SELECT coalesce(jsonb_agg(to_jsonb(inserted)), '[]'::jsonb),
               string_agg(CASE WHEN inserted.parked THEN '!' ELSE '' END
                          || inserted.request_id, E'\n')
        INTO v_leases, v_notify FROM inserted;
        IF v_notify IS NOT NULL THEN
            PERFORM pg_notify('runcell_grant', p_limiter || E'\n' || v_notify);
        END IF;
    END IF;

    IF p_caller_action = 'grant' THEN
        INSERT INTO runcell_lease (limiter, workload, request_id, fencing_token, run_id,
            root_run_id, parent_run_id, holder_name, holder_host, holder_pid, ttl_ms,
            acquired_at, renewed_at, expires_at)
        VALUES (p_limiter, p_caller->>'workload', p_caller->>'request_id',
            v_first + v_count - 1, p_caller->>'run_id', p_caller->>'root_run_id',
            p_caller->>'parent_run_id', p_caller->>'holder_name', p_caller->>'holder_host',
            (p_caller->>'holder_pid')::integer, p_ttl_ms, v_now, v_now,
            v_now + p_ttl_ms * interval '1 millisecond')
        RETURNING v_leases || jsonb_build_array(runcell_lease_json(runcell_lease))
        INTO v_leases;
    ELSIF p_caller_action = 'enqueue' THEN
        v_deadline := v_now + (p_caller->>'wait_ms')::double precision * interval '1 millisecond';
        INSERT INTO runcell_queue (request_id, limiter, workload, run_id, root_run_id,
            parent_run_id, holder_name, holder_host, holder_pid, enqueued_at, deadline,
            expires_at, in_progress)
        VALUES (p_caller->>'request_id', p_limiter, p_caller->>'workload',
            p_caller->>'run_id', p_caller->>'root_run_id', p_caller->>'parent_run_id',
            p_caller->>'holder_name', p_caller->>'holder_host',
            (p_caller->>'holder_pid')::integer, v_now, v_deadline,
            v_now + p_queue_ttl_ms * interval '1 millisecond',
            coalesce((p_caller->>'in_progress')::boolean, false));
    END IF;

    RETURN jsonb_build_object(
        'leases', v_leases,
        'wait_ms_left', extract(epoch FROM v_deadline - clock_timestamp()) * 1000
    );
END;
$$;

-- A waiter's poll, without the limiter lock: was I granted? did my deadline pass?
-- It refreshes the queue row's expiry only when a third of the TTL is left (fewer
-- writes), and says whether anything expired that needs an allocation pass.
-- Returns {"status": "granted", "lease": {...}} | {"status": "waiting",
-- "needs_allocation": bool} | {"status": "timed-out"} | {"status": "missing"}.
CREATE OR REPLACE FUNCTION runcell_poll_v1(
    p_limiter text,
    p_request_id text,
    p_queue_ttl_ms integer
) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := clock_timestamp();
    v_lease jsonb;
    v_entry runcell_queue%ROWTYPE;
BEGIN
    SELECT runcell_lease_json(l) INTO v_lease FROM runcell_lease AS l
    WHERE l.request_id = p_request_id AND l.limiter = p_limiter AND l.expires_at > v_now
      AND NOT l.parked;
    IF FOUND THEN
        RETURN jsonb_build_object('status', 'granted', 'lease', v_lease);
    END IF;

    SELECT * INTO v_entry FROM runcell_queue
    WHERE request_id = p_request_id AND limiter = p_limiter;
    IF NOT FOUND THEN
        -- Each statement reads a new snapshot: a grant that committed between the
        -- two reads above deleted the queue row and created the lease. Look again.
        SELECT runcell_lease_json(l) INTO v_lease FROM runcell_lease AS l
        WHERE l.request_id = p_request_id AND l.limiter = p_limiter AND l.expires_at > v_now
          AND NOT l.parked;
        IF FOUND THEN
            RETURN jsonb_build_object('status', 'granted', 'lease', v_lease);
        END IF;
        RETURN jsonb_build_object('status', 'missing');
    END IF;
    IF v_entry.deadline IS NOT NULL AND v_entry.deadline <= v_now THEN
        -- Leave the queue under the limiter row's lock: an allocation that chose us
        -- just before the deadline may be writing our lease right now. Once we hold
        -- the lock it has committed; if it granted us, the grant wins.
        PERFORM 1 FROM runcell_limiter WHERE name = p_limiter FOR UPDATE;
        SELECT runcell_lease_json(l) INTO v_lease FROM runcell_lease AS l
        WHERE l.request_id = p_request_id AND l.limiter = p_limiter AND NOT l.parked;
        IF FOUND THEN
            RETURN jsonb_build_object('status', 'granted', 'lease', v_lease);
        END IF;
        DELETE FROM runcell_queue WHERE request_id = p_request_id;
        RETURN jsonb_build_object('status', 'timed-out');
    END IF;
    -- Parked rows expire at 'infinity' and have nobody polling them: leave them be.
    IF NOT v_entry.parked
       AND v_entry.expires_at - v_now < p_queue_ttl_ms * interval '1 millisecond' * 2 / 3 THEN
        UPDATE runcell_queue SET expires_at = v_now + p_queue_ttl_ms * interval '1 millisecond'
        WHERE request_id = p_request_id;
    END IF;
    RETURN jsonb_build_object(
        'status', 'waiting',
        'needs_allocation',
        EXISTS (SELECT 1 FROM runcell_lease WHERE limiter = p_limiter AND expires_at <= v_now)
        OR EXISTS (SELECT 1 FROM runcell_queue WHERE limiter = p_limiter AND expires_at <= v_now)
    );
END;
$$;

-- Park a waiting request (Celery admission deferral): it keeps its place in the
-- queue but nobody polls for it; its row carries the task message to re-publish.
-- If it was granted at this very moment, return that lease instead.
-- Returns {"status": "parked"} | {"status": "granted", "lease": {...}} | {"status": "missing"}.
CREATE OR REPLACE FUNCTION runcell_park_v1(
    p_limiter text,
    p_request_id text,
    p_payload jsonb
) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
    v_lease jsonb;
BEGIN
    -- Under the limiter row's lock, like every change to who waits: otherwise an
    -- allocation that read this row as waiting could grant it a plain lease (and
    -- drop the row) while we park it, and nobody would run the parked task.
    PERFORM 1 FROM runcell_limiter WHERE name = p_limiter FOR UPDATE;
    UPDATE runcell_queue SET parked = true, payload = p_payload, expires_at = 'infinity'
    WHERE request_id = p_request_id AND limiter = p_limiter;
    IF FOUND THEN
        RETURN jsonb_build_object('status', 'parked');
    END IF;
    SELECT runcell_lease_json(l) INTO v_lease FROM runcell_lease AS l
    WHERE l.request_id = p_request_id AND l.limiter = p_limiter
      AND l.expires_at > clock_timestamp() AND NOT l.parked;
    IF FOUND THEN
        RETURN jsonb_build_object('status', 'granted', 'lease', v_lease);
    END IF;
    RETURN jsonb_build_object('status', 'missing');
END;
$$;


DELETE FROM runcell_schema WHERE checksum IS DISTINCT FROM '6406a588ed53b470';
INSERT INTO runcell_schema (checksum, version) VALUES ('6406a588ed53b470', 1) ON CONFLICT DO NOTHING;
"""

#: Back to 0001's DDL (its function bodies and checksum), then drop what this one added.
#: ``runcell_lease_json`` takes the lease row type, so it must go before that table.
DROP_NEW_FUNCTIONS = """
DROP FUNCTION IF EXISTS runcell_apply_v2(text, jsonb, jsonb, text, integer, integer);
DROP FUNCTION IF EXISTS runcell_lock_v2(text, uuid, text, text, integer);
DROP FUNCTION IF EXISTS runcell_lease_json(runcell_lease);
"""


def _previous_schema() -> str:
    from importlib import import_module

    return str(import_module("runcell_django.migrations.0001_initial").LIMITER_SCHEMA)


class Migration(migrations.Migration):
    dependencies = [("runcell_django", "0001_initial")]

    operations = [
        migrations.RunSQL(LIMITER_SCHEMA, [_previous_schema(), DROP_NEW_FUNCTIONS]),
    ]
