"""The limiter's tables, the admin's views of them, and the recorder's tables.

The limiter's tables and functions are the core's DDL as runcell_celery 0.1.0 shipped
it (``postgres_concurrency_schema_sql()``, checksum ``b62080b110d75d33``), frozen here
as text: a migration is history, so what it does never changes with the installed
library. A later change to the library's DDL arrives as a new migration carrying it
(``tests/django/test_migrations.py`` fails until one does). The limiter's models are
unmanaged: this migration only tells Django their shape.
"""

import django.db.models.deletion
from django.db import migrations, models

import runcell_django.fields

#: ``runcell_celery.postgres.postgres_concurrency_schema_sql()`` at version 1, checksum
#: b62080b110d75d33 (idempotent; it records that checksum in ``runcell_schema``).
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

-- Lock the limiter row, apply a release or a withdrawal, reap what expired, and
-- return what allocation needs. A PL/pgSQL function so that every statement after
-- the lock reads a fresh snapshot (under READ COMMITTED a single statement would
-- read rows as of before it waited for the lock) and all of it is one round trip.
--
-- Returns: {"config_hash", "active": {workload: n}, "queued": n,
--           "waiting": [[request_id, workload, position, in_progress], ...] oldest
--           first: the first max_per_workload of each workload in the order allocation
--           serves it (runs in progress first), as no more can be granted at once,
--           "mine": the lease or queue row p_request_id already has, or null}.
-- "mine" makes a retried acquire idempotent: if the first attempt committed but its
-- answer was lost with the connection, the retry finds what it already got.
-- Returns NULL if the limiter row does not exist.
CREATE OR REPLACE FUNCTION runcell_lock_v1(
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
        SELECT CASE WHEN parked THEN jsonb_build_object('parked_lease', lease_id)
                    ELSE jsonb_build_object('lease', jsonb_build_object(
                        'lease_id', lease_id, 'request_id', request_id, 'workload', workload,
                        'fencing_token', fencing_token)) END
        INTO v_mine FROM runcell_lease
        WHERE request_id = p_request_id AND limiter = p_limiter;
        IF NOT FOUND THEN
            SELECT jsonb_build_object('queued', extract(epoch FROM deadline))
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
-- limiter row is still locked (same transaction as runcell_lock_v1):
--   p_grants:  [request_id, ...] waiting requests to grant, in grant order;
--   p_caller:  the calling request as {request_id, workload, run_id, ...} or NULL;
--   p_caller_action: 'grant' (a lease now), 'enqueue' (wait) or NULL.
-- Grants get fencing tokens in order, their queue rows go, and the processes that
-- wait for them are told on channel runcell_grant (only when someone was granted:
-- NOTIFY takes a cluster-wide lock at commit). Returns the new leases as
-- [{lease_id, request_id, workload, fencing_token}] and the caller's queue deadline.
CREATE OR REPLACE FUNCTION runcell_apply_v1(
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
        RETURNING v_leases || jsonb_build_array(jsonb_build_object(
            'lease_id', lease_id, 'request_id', request_id, 'workload', workload,
            'fencing_token', fencing_token))
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
        'deadline', extract(epoch FROM v_deadline)
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
    SELECT jsonb_build_object('lease_id', lease_id, 'request_id', request_id,
                              'workload', workload, 'fencing_token', fencing_token)
    INTO v_lease FROM runcell_lease
    WHERE request_id = p_request_id AND limiter = p_limiter AND expires_at > v_now
      AND NOT parked;
    IF FOUND THEN
        RETURN jsonb_build_object('status', 'granted', 'lease', v_lease);
    END IF;

    SELECT * INTO v_entry FROM runcell_queue
    WHERE request_id = p_request_id AND limiter = p_limiter;
    IF NOT FOUND THEN
        -- Each statement reads a new snapshot: a grant that committed between the
        -- two reads above deleted the queue row and created the lease. Look again.
        SELECT jsonb_build_object('lease_id', lease_id, 'request_id', request_id,
                                  'workload', workload, 'fencing_token', fencing_token)
        INTO v_lease FROM runcell_lease
        WHERE request_id = p_request_id AND limiter = p_limiter AND expires_at > v_now
          AND NOT parked;
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
        SELECT jsonb_build_object('lease_id', lease_id, 'request_id', request_id,
                                  'workload', workload, 'fencing_token', fencing_token)
        INTO v_lease FROM runcell_lease
        WHERE request_id = p_request_id AND limiter = p_limiter AND NOT parked;
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
    SELECT jsonb_build_object('lease_id', lease_id, 'request_id', request_id,
                              'workload', workload, 'fencing_token', fencing_token)
    INTO v_lease FROM runcell_lease
    WHERE request_id = p_request_id AND limiter = p_limiter AND expires_at > clock_timestamp()
      AND NOT parked;
    IF FOUND THEN
        RETURN jsonb_build_object('status', 'granted', 'lease', v_lease);
    END IF;
    RETURN jsonb_build_object('status', 'missing');
END;
$$;


DELETE FROM runcell_schema WHERE checksum IS DISTINCT FROM 'b62080b110d75d33';
INSERT INTO runcell_schema (checksum, version) VALUES ('b62080b110d75d33', 1) ON CONFLICT DO NOTHING;
"""

#: Undo the core's DDL (every object it creates; IF EXISTS for older versions).
DROP_LIMITER_SCHEMA = """
DROP FUNCTION IF EXISTS runcell_park_v1(text, text, jsonb);
DROP FUNCTION IF EXISTS runcell_poll_v1(text, text, integer);
DROP FUNCTION IF EXISTS runcell_apply_v1(text, jsonb, jsonb, text, integer, integer);
DROP FUNCTION IF EXISTS runcell_lock_v1(text, uuid, text, text, integer);
DROP TABLE IF EXISTS runcell_admission_counter, runcell_revoked, runcell_run, runcell_queue,
    runcell_lease, runcell_limiter, runcell_schema;
DROP SEQUENCE IF EXISTS runcell_queue_position;
"""

#: The admission counters with the single-column key Django needs (the table's key is
#: task name and limiter).
CREATE_ADMISSION_VIEW = """
CREATE OR REPLACE VIEW runcell_admission AS
SELECT jsonb_build_array(task_name, limiter)::text AS id, task_name, limiter, deliveries,
       deferrals, provider_attempts, provider_failures, concurrency_failures, updated_at
FROM runcell_admission_counter
"""

DROP_ADMISSION_VIEW = "DROP VIEW IF EXISTS runcell_admission"


class Migration(migrations.Migration):
    initial = True

    dependencies = []

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[
                migrations.RunSQL(LIMITER_SCHEMA, DROP_LIMITER_SCHEMA),
                migrations.RunSQL(CREATE_ADMISSION_VIEW, DROP_ADMISSION_VIEW),
            ],
            state_operations=[
                migrations.CreateModel(
                    name="Limiter",
                    fields=[
                        (
                            "name",
                            models.TextField(
                                primary_key=True, serialize=False, verbose_name="name"
                            ),
                        ),
                        (
                            "config",
                            models.JSONField(
                                help_text="The limits every worker using this name must share.",
                                verbose_name="limits",
                            ),
                        ),
                        ("config_hash", models.TextField(verbose_name="limits checksum")),
                        (
                            "last_fencing_token",
                            models.BigIntegerField(
                                help_text="The token of the latest lease granted.",
                                verbose_name="last fencing token",
                            ),
                        ),
                        ("created_at", models.DateTimeField(verbose_name="registered at")),
                        ("updated_at", models.DateTimeField(verbose_name="limits changed at")),
                    ],
                    options={
                        "verbose_name": "limiter",
                        "verbose_name_plural": "limiters",
                        "db_table": "runcell_limiter",
                        "ordering": ("name",),
                        "managed": False,
                        "default_permissions": ("view",),
                    },
                ),
                migrations.CreateModel(
                    name="Lease",
                    fields=[
                        (
                            "limiter",
                            models.ForeignKey(
                                db_column="limiter",
                                db_constraint=False,
                                on_delete=django.db.models.deletion.DO_NOTHING,
                                related_name="leases",
                                to="runcell_django.limiter",
                                verbose_name="limiter",
                            ),
                        ),
                        ("workload", models.TextField(verbose_name="workload")),
                        (
                            "run_id",
                            models.TextField(
                                help_text="For a Celery task, the task id.",
                                null=True,
                                verbose_name="run id",
                            ),
                        ),
                        ("root_run_id", models.TextField(null=True, verbose_name="root run id")),
                        (
                            "parent_run_id",
                            models.TextField(null=True, verbose_name="parent run id"),
                        ),
                        (
                            "holder_name",
                            models.TextField(
                                help_text="The run's name: the Celery task name.",
                                null=True,
                                verbose_name="task",
                            ),
                        ),
                        ("holder_host", models.TextField(null=True, verbose_name="host")),
                        ("holder_pid", models.IntegerField(null=True, verbose_name="process id")),
                        (
                            "lease_id",
                            models.UUIDField(
                                primary_key=True, serialize=False, verbose_name="lease id"
                            ),
                        ),
                        ("request_id", models.TextField(unique=True, verbose_name="request id")),
                        (
                            "fencing_token",
                            models.BigIntegerField(
                                help_text="Grows with every lease of the limiter; a provider proxy can reject holders with an older token.",
                                verbose_name="fencing token",
                            ),
                        ),
                        ("ttl_ms", models.IntegerField(verbose_name="lease TTL (ms)")),
                        ("acquired_at", models.DateTimeField(verbose_name="acquired at")),
                        ("renewed_at", models.DateTimeField(verbose_name="renewed at")),
                        (
                            "expires_at",
                            models.DateTimeField(
                                help_text="Unless renewed before (database time).",
                                verbose_name="expires at",
                            ),
                        ),
                        (
                            "parked",
                            models.BooleanField(
                                help_text="Held for a deferred Celery task until it starts again.",
                                verbose_name="granted to a parked task",
                            ),
                        ),
                        (
                            "picked_up_at",
                            models.DateTimeField(null=True, verbose_name="picked up at"),
                        ),
                    ],
                    options={
                        "verbose_name": "lease",
                        "verbose_name_plural": "leases",
                        "db_table": "runcell_lease",
                        "ordering": ("acquired_at", "lease_id"),
                        "permissions": [("force_release_lease", "Can force-release leases")],
                        "managed": False,
                        "default_permissions": ("view",),
                    },
                ),
                migrations.CreateModel(
                    name="QueueEntry",
                    fields=[
                        (
                            "limiter",
                            models.ForeignKey(
                                db_column="limiter",
                                db_constraint=False,
                                on_delete=django.db.models.deletion.DO_NOTHING,
                                related_name="queue_entries",
                                to="runcell_django.limiter",
                                verbose_name="limiter",
                            ),
                        ),
                        ("workload", models.TextField(verbose_name="workload")),
                        (
                            "run_id",
                            models.TextField(
                                help_text="For a Celery task, the task id.",
                                null=True,
                                verbose_name="run id",
                            ),
                        ),
                        ("root_run_id", models.TextField(null=True, verbose_name="root run id")),
                        (
                            "parent_run_id",
                            models.TextField(null=True, verbose_name="parent run id"),
                        ),
                        (
                            "holder_name",
                            models.TextField(
                                help_text="The run's name: the Celery task name.",
                                null=True,
                                verbose_name="task",
                            ),
                        ),
                        ("holder_host", models.TextField(null=True, verbose_name="host")),
                        ("holder_pid", models.IntegerField(null=True, verbose_name="process id")),
                        (
                            "request_id",
                            models.TextField(
                                primary_key=True, serialize=False, verbose_name="request id"
                            ),
                        ),
                        ("position", models.BigIntegerField(verbose_name="arrival order")),
                        ("enqueued_at", models.DateTimeField(verbose_name="queued at")),
                        (
                            "deadline",
                            models.DateTimeField(
                                help_text="When the request stops waiting.",
                                null=True,
                                verbose_name="deadline",
                            ),
                        ),
                        (
                            "expires_at",
                            runcell_django.fields.EndlessDateTimeField(
                                help_text="A waiter that stops polling leaves the queue then; never when parked.",
                                verbose_name="expires at",
                            ),
                        ),
                        (
                            "in_progress",
                            models.BooleanField(
                                help_text="Its run took a slot before (an agent's next call): it goes before new runs of its workload.",
                                verbose_name="run in progress",
                            ),
                        ),
                        (
                            "parked",
                            models.BooleanField(
                                help_text="A deferred Celery task: no process waits for it.",
                                verbose_name="parked",
                            ),
                        ),
                        (
                            "granted_lease_id",
                            models.UUIDField(null=True, verbose_name="granted lease"),
                        ),
                        ("granted_at", models.DateTimeField(null=True, verbose_name="granted at")),
                        (
                            "published_at",
                            models.DateTimeField(null=True, verbose_name="re-published at"),
                        ),
                        (
                            "publication_id",
                            models.UUIDField(null=True, verbose_name="publication id"),
                        ),
                    ],
                    options={
                        "verbose_name": "queued request",
                        "verbose_name_plural": "queued requests",
                        "db_table": "runcell_queue",
                        "ordering": ("limiter", "position"),
                        "managed": False,
                        "default_permissions": ("view",),
                    },
                ),
                migrations.CreateModel(
                    name="AdmissionCount",
                    fields=[
                        ("id", models.TextField(primary_key=True, serialize=False)),
                        ("task_name", models.TextField(verbose_name="task")),
                        ("limiter", models.TextField(verbose_name="limiter")),
                        (
                            "deliveries",
                            models.BigIntegerField(
                                help_text="Times the task started: first, redelivered, re-published.",
                                verbose_name="deliveries",
                            ),
                        ),
                        (
                            "deferrals",
                            models.BigIntegerField(
                                help_text="Times it was parked until a slot freed. Not a failure, not a retry.",
                                verbose_name="deferrals",
                            ),
                        ),
                        (
                            "provider_attempts",
                            models.BigIntegerField(
                                help_text="Slots it took: one per provider request.",
                                verbose_name="provider attempts",
                            ),
                        ),
                        (
                            "provider_failures",
                            models.BigIntegerField(
                                help_text="Provider calls that raised while holding a slot.",
                                verbose_name="provider failures",
                            ),
                        ),
                        (
                            "concurrency_failures",
                            models.BigIntegerField(
                                help_text="Runs stopped by the limiter: timeout, full queue, lost lease, outage.",
                                verbose_name="concurrency failures",
                            ),
                        ),
                        ("updated_at", models.DateTimeField(verbose_name="last counted at")),
                    ],
                    options={
                        "verbose_name": "admission count",
                        "verbose_name_plural": "admission counts",
                        "db_table": "runcell_admission",
                        "ordering": ("task_name", "limiter"),
                        "managed": False,
                        "default_permissions": ("view",),
                    },
                ),
            ],
        ),
        migrations.CreateModel(
            name="Dashboard",
            fields=[],
            options={
                "verbose_name": "dashboard",
                "verbose_name_plural": "dashboard",
                "proxy": True,
                "default_permissions": ("view",),
                "indexes": [],
                "constraints": [],
            },
            bases=("runcell_django.limiter",),
        ),
        migrations.CreateModel(
            name="ConcurrencyEvent",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                (
                    "type",
                    models.CharField(
                        choices=[
                            ("wait-started", "wait-started"),
                            ("acquired", "acquired"),
                            ("timed-out", "timed-out"),
                            ("queue-full", "queue-full"),
                            ("wait-cancelled", "wait-cancelled"),
                            ("limiter-error", "limiter-error"),
                            ("config-error", "config-error"),
                            ("released", "released"),
                            ("renewal-failed", "renewal-failed"),
                            ("lease-lost", "lease-lost"),
                            ("release-failed", "release-failed"),
                            ("force-released", "force-released"),
                            ("events-dropped", "events-dropped"),
                        ],
                        max_length=32,
                        verbose_name="type",
                    ),
                ),
                ("occurred_at", models.DateTimeField(verbose_name="occurred at")),
                ("limiter", models.CharField(max_length=200, verbose_name="limiter")),
                (
                    "workload",
                    models.CharField(
                        blank=True, max_length=200, null=True, verbose_name="workload"
                    ),
                ),
                (
                    "run_id",
                    models.CharField(
                        blank=True,
                        help_text="For a Celery task, the task id.",
                        max_length=255,
                        null=True,
                        verbose_name="run id",
                    ),
                ),
                (
                    "root_run_id",
                    models.CharField(
                        blank=True, max_length=255, null=True, verbose_name="root run id"
                    ),
                ),
                (
                    "parent_run_id",
                    models.CharField(
                        blank=True, max_length=255, null=True, verbose_name="parent run id"
                    ),
                ),
                (
                    "request_id",
                    models.CharField(
                        blank=True, max_length=255, null=True, verbose_name="request id"
                    ),
                ),
                (
                    "holder_name",
                    models.CharField(
                        blank=True,
                        help_text="The run's name: the Celery task name.",
                        max_length=255,
                        null=True,
                        verbose_name="task",
                    ),
                ),
                (
                    "host",
                    models.CharField(blank=True, max_length=255, null=True, verbose_name="host"),
                ),
                ("pid", models.IntegerField(blank=True, null=True, verbose_name="process id")),
                (
                    "deadline",
                    models.DateTimeField(blank=True, null=True, verbose_name="wait deadline"),
                ),
                (
                    "lease_id",
                    models.CharField(
                        blank=True, max_length=100, null=True, verbose_name="lease id"
                    ),
                ),
                (
                    "fencing_token",
                    models.BigIntegerField(blank=True, null=True, verbose_name="fencing token"),
                ),
                ("wait_ms", models.FloatField(blank=True, null=True, verbose_name="wait (ms)")),
                ("hold_ms", models.FloatField(blank=True, null=True, verbose_name="hold (ms)")),
                (
                    "outcome",
                    models.CharField(blank=True, max_length=32, null=True, verbose_name="outcome"),
                ),
                (
                    "reason",
                    models.CharField(blank=True, max_length=32, null=True, verbose_name="reason"),
                ),
                ("error", models.TextField(blank=True, null=True, verbose_name="error")),
                (
                    "actor",
                    models.CharField(
                        blank=True,
                        help_text="Who forced a release (force-released events).",
                        max_length=150,
                        null=True,
                        verbose_name="user",
                    ),
                ),
                (
                    "dropped",
                    models.IntegerField(
                        blank=True,
                        help_text="Events a full recorder buffer dropped (events-dropped).",
                        null=True,
                        verbose_name="dropped events",
                    ),
                ),
            ],
            options={
                "verbose_name": "event",
                "verbose_name_plural": "events",
                "db_table": "runcell_event",
                "ordering": ("-occurred_at", "-id"),
                "default_permissions": ("view",),
                "indexes": [
                    models.Index(fields=["-occurred_at", "-id"], name="runcell_event_for_list"),
                    models.Index(
                        fields=["limiter", "type", "occurred_at"], name="runcell_event_for_stats"
                    ),
                    models.Index(fields=["type", "occurred_at"], name="runcell_event_for_type"),
                    models.Index(
                        fields=["workload", "occurred_at"], name="runcell_event_for_workload"
                    ),
                    models.Index(fields=["run_id"], name="runcell_event_for_run"),
                    models.Index(fields=["root_run_id"], name="runcell_event_for_root"),
                    models.Index(fields=["request_id"], name="runcell_event_for_request"),
                ],
            },
        ),
        migrations.CreateModel(
            name="OccupancySample",
            fields=[
                ("id", models.BigAutoField(primary_key=True, serialize=False)),
                ("limiter", models.CharField(max_length=200, verbose_name="limiter")),
                ("workload", models.CharField(max_length=200, verbose_name="workload")),
                ("sampled_at", models.DateTimeField(verbose_name="sampled at")),
                ("active", models.IntegerField(verbose_name="active")),
                ("queued", models.IntegerField(verbose_name="queued")),
            ],
            options={
                "verbose_name": "occupancy sample",
                "verbose_name_plural": "occupancy samples",
                "db_table": "runcell_occupancy",
                "ordering": ("-sampled_at",),
                "default_permissions": (),
                "indexes": [
                    models.Index(fields=["sampled_at"], name="runcell_occupancy_for_chart")
                ],
                "constraints": [
                    models.UniqueConstraint(
                        fields=("limiter", "workload", "sampled_at"),
                        name="runcell_occupancy_one_per_sample",
                    )
                ],
            },
        ),
    ]
