-- runcell_celery PostgreSQL limiter schema (its version: SCHEMA_VERSION in schema.py,
-- recorded in runcell_schema by postgres_concurrency_schema_sql()).
--
-- Applied on first use (under an advisory lock, so workers starting together on a
-- new database do not conflict), or as a migration with ensure_schema=False: it is
-- idempotent, and brings a database of an earlier version up to this one. One row per limiter (its stored limits and fencing counter), one row
-- per held slot (a lease: who holds it and until when), one row per waiting request.
-- Every time is database time (clock_timestamp(), never the workers' clocks).
-- Names that order locks (limiters, keys, workloads, groups) are compared byte-wise:
-- their columns are COLLATE "C", whatever the database's collation, so that the order
-- of Python's sorted() (code points, which is UTF-8's byte order) is the order here.

-- The schema version this database has: one row, checked by every worker at start
-- (a database older or newer than the worker's code is refused, naming both).
CREATE TABLE IF NOT EXISTS runcell_schema (
    version integer NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
-- Pre-release (0.1.0 development) databases kept one row per checksum of this file.
ALTER TABLE runcell_schema DROP COLUMN IF EXISTS checksum;

-- The limits every worker using this name must share, the counts allocation decides
-- on, and the lock that serialises it: every operation is one short transaction (one
-- function call) that holds this row FOR UPDATE.
CREATE TABLE IF NOT EXISTS runcell_limiter (
    name text COLLATE "C" PRIMARY KEY,
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
    limiter text COLLATE "C" NOT NULL,
    workload text COLLATE "C" NOT NULL,
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

-- One row per waiting request, in arrival order (position). A waiting row belongs to a
-- process (runcell_process): it stays while its process renews its liveness and is
-- dropped once the process stops (queue_entry_ttl_ms). Parked rows (Celery admission
-- deferral) belong to no process and carry the task message to re-publish.
CREATE SEQUENCE IF NOT EXISTS runcell_queue_position;
CREATE TABLE IF NOT EXISTS runcell_queue (
    request_id text PRIMARY KEY,
    limiter text COLLATE "C" NOT NULL,
    workload text COLLATE "C" NOT NULL,
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
    publication_id uuid,
    -- The broker a parked task must be re-published to (an identity of it, never a
    -- password): only re-publishers of that broker publish it; NULL, anyone.
    broker text
);
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

-- The processes that have requests waiting: one row each, renewed by the process's
-- safety poll, so a waiter costs the database nothing while it waits. Grants are
-- announced on the process's own channel (NOTIFY), never on a channel all share.
CREATE TABLE IF NOT EXISTS runcell_process (
    process_id text PRIMARY KEY,
    channel text NOT NULL,
    host text,
    pid integer,
    expires_at timestamptz NOT NULL
);

-- Upgrades: a database created by an earlier revision of this file has the tables but
-- not every column. CREATE TABLE IF NOT EXISTS leaves an existing table as it is, so
-- each column added since is added here too (a no-op on a new database). Functions
-- below are replaced whole.
ALTER TABLE runcell_lease ADD COLUMN IF NOT EXISTS parked boolean NOT NULL DEFAULT false;
ALTER TABLE runcell_lease ADD COLUMN IF NOT EXISTS picked_up_at timestamptz;
ALTER TABLE runcell_queue ADD COLUMN IF NOT EXISTS in_progress boolean NOT NULL DEFAULT false;
ALTER TABLE runcell_queue ADD COLUMN IF NOT EXISTS parked boolean NOT NULL DEFAULT false;
ALTER TABLE runcell_queue ADD COLUMN IF NOT EXISTS payload jsonb;
ALTER TABLE runcell_queue ADD COLUMN IF NOT EXISTS granted_lease_id uuid;
ALTER TABLE runcell_queue ADD COLUMN IF NOT EXISTS granted_at timestamptz;
ALTER TABLE runcell_queue ADD COLUMN IF NOT EXISTS published_at timestamptz;
ALTER TABLE runcell_queue ADD COLUMN IF NOT EXISTS publication_id uuid;
ALTER TABLE runcell_queue ADD COLUMN IF NOT EXISTS broker text;

ALTER TABLE runcell_queue ADD COLUMN IF NOT EXISTS process_id text;
-- A parked request whose deadline passed is taken out of line (expired_at, no longer
-- counted as waiting) and kept until its task's failure is recorded: failing_by and
-- failing_at say which sweeper records it, since when (another may take over if it
-- does not finish). Only then is the row deleted: parked work never vanishes.
ALTER TABLE runcell_queue ADD COLUMN IF NOT EXISTS expired_at timestamptz;
ALTER TABLE runcell_queue ADD COLUMN IF NOT EXISTS failing_by text;
ALTER TABLE runcell_queue ADD COLUMN IF NOT EXISTS failing_at timestamptz;
CREATE INDEX IF NOT EXISTS runcell_queue_for_failing ON runcell_queue (failing_at)
    WHERE expired_at IS NOT NULL;

-- Operations on parked requests (park, claim, withdraw, complete) already done, by the
-- client's operation id, with the answer they gave: a retry after a lost reply gets
-- that answer again instead of acting twice or reading its own work as another's.
-- Kept a while (purged by age by the sweepers' pass).
CREATE TABLE IF NOT EXISTS runcell_operation (
    op_id uuid PRIMARY KEY,
    result jsonb,
    at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX IF NOT EXISTS runcell_operation_for_purge ON runcell_operation (at);
-- The limits in array form (workloads sorted by name) and the kept counts: slots held
-- and requests waiting (or parked, not granted) per workload. Allocation reads these,
-- never count(*), so its cost does not grow with the queue.
ALTER TABLE runcell_limiter ADD COLUMN IF NOT EXISTS workloads text[] COLLATE "C" NOT NULL DEFAULT '{}';
ALTER TABLE runcell_limiter ADD COLUMN IF NOT EXISTS ceilings integer[] NOT NULL DEFAULT '{}';
ALTER TABLE runcell_limiter ADD COLUMN IF NOT EXISTS reserved integer[] NOT NULL DEFAULT '{}';
ALTER TABLE runcell_limiter ADD COLUMN IF NOT EXISTS priorities integer[] NOT NULL DEFAULT '{}';
ALTER TABLE runcell_limiter ADD COLUMN IF NOT EXISTS max_concurrent integer NOT NULL DEFAULT 0;
ALTER TABLE runcell_limiter ADD COLUMN IF NOT EXISTS max_queued integer;
ALTER TABLE runcell_limiter ADD COLUMN IF NOT EXISTS lease_ttl_ms integer NOT NULL DEFAULT 30000;
ALTER TABLE runcell_limiter ADD COLUMN IF NOT EXISTS active integer[] NOT NULL DEFAULT '{}';
ALTER TABLE runcell_limiter ADD COLUMN IF NOT EXISTS waiting integer[] NOT NULL DEFAULT '{}';
-- How long a slot of this limiter is held, on average (milliseconds): an exponentially
-- weighted mean of recent holds (weight 0.2 for the newest), kept by the release in
-- the update it makes anyway. NULL until the first release. A queued acquire answers
-- with it so a deferrable task can tell a short wait from a long one (docs/celery.md,
-- "When a task parks").
ALTER TABLE runcell_limiter ADD COLUMN IF NOT EXISTS hold_ms_avg double precision;
-- A key of a keyed limiter (``limiter.key("acme")``): a limiter row named
-- "<keyed limiter>:<key>" whose parent is the keyed limiter's row. It is created by the
-- first operation that names it (runcell_create_key, copying the keyed limiter's
-- limits) and deleted once idle (runcell_purge_idle_keys), so 100,000 tenants
-- leave no rows behind. NULL for every other limiter.
ALTER TABLE runcell_limiter ADD COLUMN IF NOT EXISTS parent text COLLATE "C";
CREATE INDEX IF NOT EXISTS runcell_limiter_keys ON runcell_limiter (parent)
    WHERE parent IS NOT NULL;
-- The limiters that are not keys, for operators' lists (a fleet may have 100,000
-- keys). Neither column ever changes, so the hot row's updates stay HOT.
CREATE INDEX IF NOT EXISTS runcell_limiter_not_keys ON runcell_limiter (name)
    WHERE parent IS NULL;
-- Fairness between keys (limits option fairness "round_robin"): a waiting request's
-- key (a tenant; NULL: the keyless requests, which count as one key together), and per
-- limiter the fencing token of each key's latest grant, so that ties between keys go
-- to the one served longest ago (runcell_celery.allocation.allocate_several).
ALTER TABLE runcell_queue ADD COLUMN IF NOT EXISTS fair_key text COLLATE "C";
-- A request over several limiters (``slot(openai, gpt_4o, tenant.key("acme"))``) waits
-- as one queue row per limiter, its member "<request id>|<limiter>", all with the
-- request's id (group_id) and its limiters in lock order (group_limiters). It is
-- granted only all together, by runcell_grant_request, which locks those limiters in
-- that order: allocation in one of them never grants a member itself.
ALTER TABLE runcell_queue ADD COLUMN IF NOT EXISTS group_id text COLLATE "C";
ALTER TABLE runcell_queue ADD COLUMN IF NOT EXISTS group_limiters text[] COLLATE "C";
CREATE INDEX IF NOT EXISTS runcell_queue_groups ON runcell_queue (group_id)
    WHERE group_id IS NOT NULL;
-- Parked requests over several limiters no process waits for: the sweepers run their
-- group passes, heads of line first.
CREATE INDEX IF NOT EXISTS runcell_queue_for_parked_groups ON runcell_queue (position)
    WHERE parked AND group_id IS NOT NULL AND granted_lease_id IS NULL;
CREATE TABLE IF NOT EXISTS runcell_fair_history (
    limiter text COLLATE "C" NOT NULL,
    fair_key text COLLATE "C" NOT NULL,  -- '' for the keyless requests (a key is never empty)
    last_granted bigint NOT NULL,
    PRIMARY KEY (limiter, fair_key)
);
-- When each key was last served, so that the history of keys idle for a while is
-- purged (runcell_purge_fair_history): 100,000 tenants leave no rows behind.
ALTER TABLE runcell_fair_history ADD COLUMN IF NOT EXISTS granted_at timestamptz;
CREATE INDEX IF NOT EXISTS runcell_fair_history_for_purge ON runcell_fair_history (granted_at);
-- A database created by an earlier revision has these columns in its own collation
-- (en-US on most managed services, where "gpt-4o" sorts before "OpenAI"): they become
-- COLLATE "C" once. The table is not rewritten (same type); the indexes over them are
-- rebuilt. Columns already in "C" are left alone, so a current database does nothing.
DO $$
DECLARE
    v_column record;
BEGIN
    FOR v_column IN
        SELECT w.rel, w.col, format_type(a.atttypid, a.atttypmod) AS type
        FROM (VALUES ('runcell_limiter', 'name'), ('runcell_limiter', 'parent'),
                     ('runcell_limiter', 'workloads'), ('runcell_lease', 'limiter'),
                     ('runcell_lease', 'workload'), ('runcell_queue', 'limiter'),
                     ('runcell_queue', 'workload'), ('runcell_queue', 'fair_key'),
                     ('runcell_queue', 'group_id'), ('runcell_queue', 'group_limiters'),
                     ('runcell_fair_history', 'limiter'),
                     ('runcell_fair_history', 'fair_key')) AS w(rel, col)
        JOIN pg_attribute a ON a.attrelid = to_regclass(w.rel) AND a.attname = w.col
        WHERE a.attcollation <> 'pg_catalog."C"'::regcollation
    LOOP
        EXECUTE format('ALTER TABLE %I ALTER COLUMN %I TYPE %s COLLATE "C"',
                       v_column.rel, v_column.col, v_column.type);
    END LOOP;
END;
$$;
-- The limiter row is written by every operation: room on its page keeps those updates
-- HOT (pruned in place), so it stays fast without VACUUM.
ALTER TABLE runcell_limiter SET (fillfactor = 20);
ALTER TABLE runcell_lease SET (fillfactor = 70);
ALTER TABLE runcell_queue SET (fillfactor = 70);
-- The head of each workload's line, in the order allocation serves it; only rows
-- still waiting are indexed.
CREATE INDEX IF NOT EXISTS runcell_queue_for_heads ON runcell_queue
    (limiter, workload, in_progress DESC, position) WHERE granted_lease_id IS NULL;
DROP INDEX IF EXISTS runcell_queue_for_allocation;
DROP INDEX IF EXISTS runcell_queue_for_reap;
DROP INDEX IF EXISTS runcell_lease_for_counts;


-- The functions of the pre-release (0.1.0 development) revisions carried a version
-- suffix (runcell_acquire_v3, runcell_allocate_group_v5, ...): they are dropped, so a
-- worker of such a revision fails closed (docs/postgres.md, "Upgrading": stop every worker).
DO $$
DECLARE
    v_old regprocedure;
BEGIN
    FOR v_old IN
        SELECT p.oid::regprocedure FROM pg_catalog.pg_proc p
        WHERE p.proname ~ '^runcell_.*_v[0-9]+$'
          AND p.pronamespace = ANY(ARRAY(SELECT oid FROM pg_catalog.pg_namespace
                                         WHERE nspname = ANY(current_schemas(false))))
    LOOP
        EXECUTE 'DROP FUNCTION ' || v_old::text;
    END LOOP;
END;
$$;

-- The answer of an operation that finds or makes a lease: {"s": status, "now": the
-- database's clock (epoch seconds), "lease": [lease_id, fencing_token], "leases": the
-- same as a list of one (the answer of a request over several members: a request over
-- one answers in both shapes)}. Every function that answers with a lease builds it here.
CREATE OR REPLACE FUNCTION runcell_answer(
    p_status text, p_now timestamptz, p_lease_id uuid, p_token bigint
) RETURNS jsonb LANGUAGE sql IMMUTABLE AS $$
    SELECT jsonb_build_object('s', p_status, 'now', extract(epoch FROM p_now),
                              'lease', jsonb_build_array(p_lease_id, p_token),
                              'leases', jsonb_build_array(jsonb_build_array(p_lease_id, p_token)))
$$;

-- Operation ids (runcell_operation): begin returns the answer an earlier attempt of
-- the same operation committed, or NULL after claiming the id for this transaction (an
-- attempt still running elsewhere is waited for: the id's row is locked until it ends);
-- end records the answer and returns it. A NULL id records nothing.
CREATE OR REPLACE FUNCTION runcell_op_begin(p_op_id uuid) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
    v_result jsonb;
BEGIN
    IF p_op_id IS NULL THEN
        RETURN NULL;
    END IF;
    INSERT INTO runcell_operation (op_id) VALUES (p_op_id) ON CONFLICT (op_id) DO NOTHING;
    IF FOUND THEN
        RETURN NULL;
    END IF;
    SELECT result INTO v_result FROM runcell_operation WHERE op_id = p_op_id;
    RETURN coalesce(v_result, '{"s": "missing"}'::jsonb);
END;
$$;

CREATE OR REPLACE FUNCTION runcell_op_end(p_op_id uuid, p_result jsonb) RETURNS jsonb
LANGUAGE plpgsql AS $$
BEGIN
    IF p_op_id IS NOT NULL THEN
        UPDATE runcell_operation SET result = p_result WHERE op_id = p_op_id;
    END IF;
    RETURN p_result;
END;
$$;

-- has_room: the rule of runcell_celery.allocation.has_room over the kept counts. A
-- workload may take one more slot if it stays under its ceiling and the slots other
-- workloads reserved but do not use stay free.
CREATE OR REPLACE FUNCTION runcell_has_room(
    p_active integer[], p_ceilings integer[], p_reserved integer[], p_max integer, p_i integer
) RETURNS boolean LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    v_total integer := 0;
    v_kept integer := 0;
    v_j integer;
BEGIN
    IF p_active[p_i] >= p_ceilings[p_i] THEN
        RETURN false;
    END IF;
    FOR v_j IN 1 .. coalesce(array_length(p_active, 1), 0) LOOP
        v_total := v_total + p_active[v_j];
        IF v_j <> p_i AND p_reserved[v_j] > p_active[v_j] THEN
            v_kept := v_kept + p_reserved[v_j] - p_active[v_j];
        END IF;
    END LOOP;
    RETURN v_total + 1 + v_kept <= p_max;
END;
$$;

-- Grant waiters while any workload that has waiters has room: the loop of
-- runcell_celery.allocation.allocate (priority among workloads with room, then the
-- longest waiter; runs in progress first, then arrival order, within a workload).
-- Each workload's line is read in that order through runcell_queue_for_heads: its
-- head by one probe, and further rows by a cursor, one at a time as grants need
-- them: granting 10,000 at once reads each row once. Runs under the limiter row's lock on the row's kept counts, passed in and
-- out so the hot row is written once per transaction. Waiters whose process stopped
-- renewing are dropped on the way (at most 100 per call). The processes of the
-- granted waiters are told here (runcell_notify_grants), except about
-- p_skip_request, which the caller answers itself.
-- Grants come back in grant order as parallel arrays: request ids, lease ids, fencing
-- tokens, and whether each went to a parked request.
-- A workload's line in a round-robin limiter, in the order allocation serves it (the
-- order of runcell_celery.allocation.allocate_several): runs in progress first; then
-- each key's first waiting request before any key's second (rank), ties to the key
-- whose latest grant is oldest (never granted: first), then arrival. Every waiting row
-- of the workload is ranked, so a round-robin limiter's allocation costs O(n log n)
-- in its line (a first-come, first-served limiter's reads only the head).
CREATE OR REPLACE FUNCTION runcell_fair_line(
    p_limiter text, p_workload text, p_now timestamptz
) RETURNS TABLE (request_id text, "position" bigint) LANGUAGE sql STABLE AS $$
    SELECT w.request_id, w.position
    FROM (SELECT q.request_id, q.position, q.in_progress,
                 row_number() OVER (PARTITION BY q.in_progress, q.fair_key
                                    ORDER BY q.position) AS rank,
                 coalesce(h.last_granted, -1) AS last_granted
          FROM runcell_queue q
          LEFT JOIN runcell_fair_history h
            ON h.limiter = q.limiter AND h.fair_key = coalesce(q.fair_key, '')
          WHERE q.limiter = p_limiter AND q.workload = p_workload
            AND q.granted_lease_id IS NULL
            AND (q.deadline IS NULL OR q.deadline > p_now)) AS w
    ORDER BY w.in_progress DESC, w.rank, w.last_granted, w.position
$$;

-- Remember a round-robin limiter's grant to a key (its fencing token: increasing).
CREATE OR REPLACE FUNCTION runcell_fair_granted(
    p_limiter text, p_key text, p_token bigint
) RETURNS void LANGUAGE sql AS $$
    INSERT INTO runcell_fair_history (limiter, fair_key, last_granted, granted_at)
    VALUES (p_limiter, coalesce(p_key, ''), p_token, clock_timestamp())
    ON CONFLICT (limiter, fair_key) DO UPDATE
    SET last_granted = EXCLUDED.last_granted, granted_at = EXCLUDED.granted_at
$$;

-- Forget the round-robin history of keys served longer than p_idle_ms ago that have no
-- request waiting in that limiter, up to p_limit rows: such a key, back later, is
-- served like a new one (before keys served since). Rows being written are skipped,
-- never waited for. Returns how many went; asynchronous commit.
CREATE OR REPLACE FUNCTION runcell_purge_fair_history(p_idle_ms integer, p_limit integer)
RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
    v_gone integer;
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    WITH idle AS (
        SELECT h.limiter, h.fair_key FROM runcell_fair_history h
        WHERE (h.granted_at IS NULL
               OR h.granted_at < clock_timestamp() - p_idle_ms * interval '1 millisecond')
          AND NOT EXISTS (SELECT 1 FROM runcell_queue q
                          WHERE q.limiter = h.limiter AND coalesce(q.fair_key, '') = h.fair_key
                            AND q.granted_lease_id IS NULL)
        LIMIT p_limit
        FOR UPDATE OF h SKIP LOCKED
    )
    DELETE FROM runcell_fair_history h USING idle
    WHERE h.limiter = idle.limiter AND h.fair_key = idle.fair_key;
    GET DIAGNOSTICS v_gone = ROW_COUNT;
    RETURN v_gone;
END;
$$;

-- The several-limiter waiting rule (docs/slots.md, "Several limits and keys"; the same
-- rule as runcell_celery.allocation.allocate_several). A request over several limiters
-- waits as one row per limiter, each at its arrival place in that limiter's line, and
-- holds no capacity while it waits: allocation in a limiter passes over its row and
-- serves those behind it, unless the row holds its place (below). It holds its place,
-- its slot set aside as a blocking head, when
--   * every other of its limiters has room for it: only this one lacks it, so it is
--     served here at its place, like any waiter; or
--   * it is aged: it has waited GROUP_AGEING_MS (runcell_celery.allocation, 2,000 ms)
--     since it was first queued (database time): then in each of its limiters its
--     slot is set aside as it frees, and it is granted once all are free.
-- Read without the other limiters' locks: it decides what to set aside and try, never
-- what to grant (runcell_grant_request decides that under every lock, in order).
CREATE OR REPLACE FUNCTION runcell_group_holds_place(
    p_group text, p_limiters text[], p_here text, p_enqueued_at timestamptz, p_now timestamptz
) RETURNS boolean LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_limiter text;
    v_row runcell_limiter;
    v_j integer;
BEGIN
    -- 2000: GROUP_AGEING_MS of runcell_celery.allocation.
    IF p_enqueued_at <= p_now - 2000 * interval '1 millisecond' THEN
        RETURN true;
    END IF;
    FOREACH v_limiter IN ARRAY coalesce(p_limiters, '{}') LOOP
        CONTINUE WHEN v_limiter = p_here;
        SELECT l.* INTO v_row FROM runcell_limiter l WHERE l.name = v_limiter;
        IF NOT FOUND THEN
            RETURN false;
        END IF;
        v_j := array_position(v_row.workloads,
                              (SELECT q.workload FROM runcell_queue q
                               WHERE q.request_id = p_group || '|' || v_limiter));
        IF v_j IS NULL
           OR NOT runcell_has_room(v_row.active, v_row.ceilings, v_row.reserved,
                                   v_row.max_concurrent, v_j) THEN
            RETURN false;
        END IF;
    END LOOP;
    RETURN true;
END;
$$;

-- Whether a request over one limiter waits ahead of member p_member in its workload's
-- line (it would be served first: first come, first served).
CREATE OR REPLACE FUNCTION runcell_single_ahead(p_member text, p_now timestamptz)
RETURNS boolean LANGUAGE sql STABLE AS $$
    SELECT EXISTS (
        SELECT 1 FROM runcell_queue m JOIN runcell_queue q
          ON q.limiter = m.limiter AND q.workload = m.workload
        WHERE m.request_id = p_member
          AND q.granted_lease_id IS NULL AND q.group_id IS NULL
          AND (q.deadline IS NULL OR q.deadline > p_now)
          AND q.position < m.position)
$$;

CREATE OR REPLACE FUNCTION runcell_allocate(
    INOUT p_row runcell_limiter,
    p_now timestamptz,
    p_skip_request text,
    OUT requests text[],
    OUT leases uuid[],
    OUT tokens bigint[],
    OUT parked boolean[]
) LANGUAGE plpgsql AS $$
DECLARE
    v_n integer := coalesce(array_length(p_row.workloads, 1), 0);
    v_probed boolean[];
    v_opened boolean[];
    v_loaded boolean[];
    v_head_request text[];
    v_head_position bigint[];
    v_cursor refcursor;
    v_best integer;
    v_i integer;
    v_request text;
    v_position bigint;
    v_parked boolean;
    v_process text;
    v_expires timestamptz;
    v_channel text;
    v_channels text[] := '{}';
    v_lease_id uuid;
    v_dropped integer := 0;
    v_fair boolean := (p_row.config->>'fairness') IS NOT DISTINCT FROM 'round_robin';
    v_key text;
    -- Slots held as allocation sees them in this pass: held, plus one set aside for
    -- each request over several limiters that holds its place (the waiting rule).
    v_eff integer[] := p_row.active;
    v_enqueued timestamptz;
    v_group text;
    v_group_limiters text[];
    v_seen_groups text[] := '{}';
BEGIN
    requests := '{}';
    leases := '{}';
    tokens := '{}';
    parked := '{}';
    v_probed := array_fill(false, ARRAY[greatest(v_n, 1)]);
    v_opened := array_fill(false, ARRAY[greatest(v_n, 1)]);
    v_loaded := array_fill(false, ARRAY[greatest(v_n, 1)]);
    v_head_request := array_fill(NULL::text, ARRAY[greatest(v_n, 1)]);
    v_head_position := array_fill(NULL::bigint, ARRAY[greatest(v_n, 1)]);
    LOOP
        v_best := NULL;
        FOR v_i IN 1 .. v_n LOOP
            CONTINUE WHEN p_row.waiting[v_i] <= 0;
            CONTINUE WHEN NOT runcell_has_room(v_eff, p_row.ceilings, p_row.reserved,
                                                  p_row.max_concurrent, v_i);
            IF NOT v_loaded[v_i] THEN
                IF NOT v_probed[v_i] THEN
                    -- The first head: one probe of the index (the usual case, one
                    -- release granting one waiter, opens no cursor).
                    IF v_fair THEN
                        -- A round-robin line is ranked once for the whole pass (as
                        -- allocate_several ranks it once per call): read through a
                        -- cursor from its first row.
                        v_cursor := 'runcell_heads_' || v_i;
                        OPEN v_cursor FOR
                            SELECT f.request_id, f.position
                            FROM runcell_fair_line(p_row.name, p_row.workloads[v_i], p_now) f;
                        v_opened[v_i] := true;
                        FETCH v_cursor INTO v_request, v_position;
                    ELSE
                        SELECT q.request_id, q.position INTO v_request, v_position
                        FROM runcell_queue q
                        WHERE q.limiter = p_row.name AND q.workload = p_row.workloads[v_i]
                          AND q.granted_lease_id IS NULL
                          AND (q.deadline IS NULL OR q.deadline > p_now)
                        ORDER BY q.in_progress DESC, q.position
                        LIMIT 1;
                    END IF;
                    v_probed[v_i] := true;
                ELSE
                    -- Later heads: a cursor, opened once, which does not see the rows
                    -- this transaction granted or dropped already.
                    v_cursor := 'runcell_heads_' || v_i;
                    IF NOT v_opened[v_i] THEN
                        OPEN v_cursor FOR
                            SELECT q.request_id, q.position FROM runcell_queue q
                            WHERE q.limiter = p_row.name AND q.workload = p_row.workloads[v_i]
                              AND q.granted_lease_id IS NULL
                              AND (q.deadline IS NULL OR q.deadline > p_now)
                            ORDER BY q.in_progress DESC, q.position;
                        v_opened[v_i] := true;
                    END IF;
                    FETCH v_cursor INTO v_request, v_position;
                END IF;
                v_head_request[v_i] := CASE WHEN FOUND THEN v_request END;
                v_head_position[v_i] := CASE WHEN FOUND THEN v_position END;
                v_loaded[v_i] := true;
            END IF;
            CONTINUE WHEN v_head_request[v_i] IS NULL;
            IF v_best IS NULL OR p_row.priorities[v_i] > p_row.priorities[v_best]
               OR (p_row.priorities[v_i] = p_row.priorities[v_best]
                   AND v_head_position[v_i] < v_head_position[v_best]) THEN
                v_best := v_i;
            END IF;
        END LOOP;
        EXIT WHEN v_best IS NULL;

        v_request := v_head_request[v_best];
        v_loaded[v_best] := false;
        SELECT q.parked, q.process_id, q.expires_at, p.channel, q.fair_key, q.group_id,
               q.group_limiters, q.enqueued_at
        INTO v_parked, v_process, v_expires, v_channel, v_key, v_group, v_group_limiters,
             v_enqueued
        FROM runcell_queue q
        LEFT JOIN runcell_process p ON p.process_id = q.process_id AND p.expires_at > p_now
        WHERE q.request_id = v_request;
        IF NOT v_parked AND v_channel IS NULL
           AND NOT (v_process IS NULL AND v_expires > p_now) THEN
            -- Its process stopped renewing: it will never take the slot.
            DELETE FROM runcell_queue WHERE request_id = v_request;
            p_row.waiting[v_best] := p_row.waiting[v_best] - 1;
            v_dropped := v_dropped + 1;
            EXIT WHEN v_dropped >= 100;
            CONTINUE;
        END IF;
        IF v_group IS NOT NULL THEN
            -- A member of a request over several limiters: granted only together, by
            -- runcell_grant_request (which locks all its limiters in order). It holds
            -- nothing here while it waits, unless it holds its place (the waiting rule,
            -- runcell_group_holds_place): then its slot is set aside, and the caller is
            -- told to run its group pass (runcell.due_groups); otherwise allocation goes
            -- on with those behind it.
            -- (A row is met twice when the line's cursor starts at the head the first
            -- probe read: its slot is set aside once.)
            IF NOT (v_group = ANY(v_seen_groups))
               AND runcell_group_holds_place(v_group, v_group_limiters, p_row.name, v_enqueued,
                                             p_now) THEN
                v_seen_groups := v_seen_groups || v_group;
                v_eff[v_best] := v_eff[v_best] + 1;
                -- At most a few group passes per allocation (the others' own processes
                -- run theirs every second).
                IF cardinality(v_seen_groups) <= 4 THEN
                    PERFORM set_config('runcell.due_groups',
                        coalesce(current_setting('runcell.due_groups', true), '')
                            || v_group || E'\n', true);
                END IF;
            END IF;
            CONTINUE;
        END IF;

        p_row.last_fencing_token := p_row.last_fencing_token + 1;
        IF v_parked THEN
            -- Held for the parked task only for the claim window (the limits'
            -- claim_window_ms; 5 s, or the lease TTL if shorter, when omitted): not
            -- claimed by then, the lease expires, the next in line gets the slot and the
            -- row goes to the back (runcell_drop_expired_leases). The claim extends it to
            -- the full TTL (runcell_claim).
            INSERT INTO runcell_lease (limiter, workload, request_id, fencing_token, run_id,
                root_run_id, parent_run_id, holder_name, holder_host, holder_pid, ttl_ms,
                acquired_at, renewed_at, expires_at, parked)
            SELECT p_row.name, q.workload, q.request_id, p_row.last_fencing_token, q.run_id,
                q.root_run_id, q.parent_run_id, q.holder_name, q.holder_host, q.holder_pid,
                p_row.lease_ttl_ms, p_now, p_now,
                p_now + least(coalesce((p_row.config->>'claim_window_ms')::integer, 5000),
                              p_row.lease_ttl_ms) * interval '1 millisecond', true
            FROM runcell_queue q WHERE q.request_id = v_request
            RETURNING lease_id INTO v_lease_id;
            UPDATE runcell_queue SET granted_lease_id = v_lease_id, granted_at = p_now
            WHERE request_id = v_request;
        ELSE
            WITH granted AS (DELETE FROM runcell_queue WHERE request_id = v_request RETURNING *)
            INSERT INTO runcell_lease (limiter, workload, request_id, fencing_token, run_id,
                root_run_id, parent_run_id, holder_name, holder_host, holder_pid, ttl_ms,
                acquired_at, renewed_at, expires_at, parked)
            SELECT p_row.name, g.workload, g.request_id, p_row.last_fencing_token, g.run_id,
                g.root_run_id, g.parent_run_id, g.holder_name, g.holder_host, g.holder_pid,
                p_row.lease_ttl_ms, p_now, p_now,
                p_now + p_row.lease_ttl_ms * interval '1 millisecond', false
            FROM granted g
            RETURNING lease_id INTO v_lease_id;
        END IF;
        p_row.waiting[v_best] := p_row.waiting[v_best] - 1;
        p_row.active[v_best] := p_row.active[v_best] + 1;
        v_eff[v_best] := v_eff[v_best] + 1;
        IF v_fair THEN
            PERFORM runcell_fair_granted(p_row.name, v_key, p_row.last_fencing_token);
        END IF;
        requests := requests || v_request;
        leases := leases || v_lease_id;
        tokens := tokens || p_row.last_fencing_token;
        parked := parked || v_parked;
        v_channels := v_channels || CASE WHEN v_request IS DISTINCT FROM p_skip_request
                                         THEN v_channel END;
    END LOOP;
    FOR v_i IN 1 .. v_n LOOP
        IF v_opened[v_i] THEN
            v_cursor := 'runcell_heads_' || v_i;
            CLOSE v_cursor;
        END IF;
    END LOOP;
    IF cardinality(requests) > 0 THEN
        PERFORM runcell_notify_grants(p_row.name, p_now, requests, leases, tokens, parked,
                                         v_channels);
    END IF;
END;
$$;

-- Tell the processes whose waiters were granted, each on its own channel
-- ({"l": limiter, "t": grant time, "g": [[request_id, lease_id, token], ...]}), and the
-- publishers of parked tasks on runcell_parked ({"l": limiter, "p": [request_id, ...]}).
-- Payloads stay far below PostgreSQL's 8,000-byte limit whatever the number of
-- grants: at most 25 grants per notification (request ids are at most 200
-- characters), as many notifications as needed. A grant with no channel (parked, or
-- answered by the caller) is not sent to a process.
CREATE OR REPLACE FUNCTION runcell_notify_grants(
    p_limiter text, p_now timestamptz, p_requests text[], p_leases uuid[],
    p_tokens bigint[], p_parked boolean[], p_channels text[]
) RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    v_channel text;
    v_batch jsonb;
BEGIN
    IF cardinality(p_requests) = 1 THEN
        -- The usual case (one release, one grant): no grouping.
        IF p_parked[1] THEN
            PERFORM pg_notify('runcell_parked', jsonb_build_object(
                'l', p_limiter, 'p', jsonb_build_array(p_requests[1]))::text);
        ELSIF p_channels[1] IS NOT NULL THEN
            PERFORM pg_notify(p_channels[1], jsonb_build_object(
                'l', p_limiter, 't', extract(epoch FROM p_now),
                'g', jsonb_build_array(jsonb_build_array(
                    p_requests[1], p_leases[1]::text, p_tokens[1])))::text);
        END IF;
        RETURN;
    END IF;
    FOR v_channel, v_batch IN
        SELECT c, jsonb_agg(jsonb_build_array(r, l::text, t) ORDER BY o)
        FROM (SELECT r, l, t, c, o, (row_number() OVER (PARTITION BY c ORDER BY o) - 1) / 25 AS chunk
              FROM unnest(p_requests, p_leases, p_tokens, p_parked, p_channels)
                   WITH ORDINALITY AS g(r, l, t, pk, c, o)
              WHERE NOT pk AND c IS NOT NULL) AS waiting
        GROUP BY c, chunk
    LOOP
        PERFORM pg_notify(v_channel, jsonb_build_object(
            'l', p_limiter, 't', extract(epoch FROM p_now), 'g', v_batch)::text);
    END LOOP;
    FOR v_batch IN
        SELECT jsonb_agg(r ORDER BY o)
        FROM (SELECT r, o, (row_number() OVER (ORDER BY o) - 1) / 25 AS chunk
              FROM unnest(p_requests, p_parked) WITH ORDINALITY AS g(r, pk, o)
              WHERE pk) AS parked
        GROUP BY chunk
    LOOP
        PERFORM pg_notify('runcell_parked', jsonb_build_object('l', p_limiter, 'p', v_batch)::text);
    END LOOP;
END;
$$;

-- The lease ids of the grants that went to parked requests (their tasks to re-publish).
CREATE OR REPLACE FUNCTION runcell_parked_leases(p_leases uuid[], p_parked boolean[])
RETURNS jsonb LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    IF p_parked IS NULL OR NOT (true = ANY(p_parked)) THEN
        RETURN '[]'::jsonb;
    END IF;
    RETURN (SELECT jsonb_agg(l ORDER BY o) FROM unnest(p_leases, p_parked)
            WITH ORDINALITY AS g(l, pk, o) WHERE pk);
END;
$$;

-- Write the kept counts and the fencing counter back to the limiter row (once per
-- transaction). PL/pgSQL, so its statement's plan is kept for the session.
CREATE OR REPLACE FUNCTION runcell_store_counts(p_row runcell_limiter) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE runcell_limiter
    SET active = p_row.active, waiting = p_row.waiting,
        last_fencing_token = p_row.last_fencing_token
    WHERE name = p_row.name;
END;
$$;

-- Delete up to p_limit leases of the limiter that expired (holders that crashed or
-- stopped renewing), keeping the counts. A parked grant whose task did not claim it
-- within the claim window goes back in line at the back of its workload's line (a new
-- position; a run in progress stays ahead of new runs): one message slow to arrive
-- cannot hold the head of the line, and the parked task is granted again, and
-- re-published, when its turn comes round.
CREATE OR REPLACE FUNCTION runcell_drop_expired_leases(
    INOUT p_row runcell_limiter, p_now timestamptz, p_limit integer, OUT reaped integer
) LANGUAGE plpgsql AS $$
DECLARE
    v_lease record;
    v_i integer;
BEGIN
    reaped := 0;
    FOR v_lease IN
        -- expires_at again outside the subquery: a lease claimed (renewed) while this
        -- waited for its row lock is rechecked on its new version and kept.
        DELETE FROM runcell_lease WHERE lease_id IN (
            SELECT lease_id FROM runcell_lease
            WHERE limiter = p_row.name AND expires_at <= p_now
            ORDER BY expires_at LIMIT p_limit)
          AND expires_at <= p_now
        RETURNING lease_id, workload, parked
    LOOP
        reaped := reaped + 1;
        v_i := array_position(p_row.workloads, v_lease.workload);
        CONTINUE WHEN v_i IS NULL;
        p_row.active[v_i] := greatest(0, p_row.active[v_i] - 1);
        IF v_lease.parked THEN
            UPDATE runcell_queue
            SET granted_lease_id = NULL, granted_at = NULL, published_at = NULL,
                publication_id = NULL, position = nextval('runcell_queue_position')
            WHERE granted_lease_id = v_lease.lease_id;
            IF FOUND THEN
                p_row.waiting[v_i] := p_row.waiting[v_i] + 1;
            END IF;
        END IF;
    END LOOP;
END;
$$;

-- Create the row of a key of a keyed limiter ("tenant:acme" for the keyed limiter
-- "tenant") with the keyed limiter's limits and no counts; false when the name is not
-- such a key. Another transaction creating it at the same moment is waited for. A key
-- deleted while idle and created again continues above every fencing token its
-- earlier rows gave: the purge raises the keyed limiter's last_fencing_token (which
-- it never uses itself) to theirs, and a new key starts from it, read after the
-- insert so a purge that just committed is seen.
CREATE OR REPLACE FUNCTION runcell_create_key(p_name text) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    v_parent text := split_part(p_name, ':', 1);
BEGIN
    IF v_parent = p_name OR v_parent = '' THEN
        RETURN false;
    END IF;
    INSERT INTO runcell_limiter (name, config, config_hash, last_fencing_token, workloads,
        ceilings, reserved, priorities, max_concurrent, max_queued, lease_ttl_ms, active,
        waiting, parent)
    SELECT p_name, p.config, p.config_hash, p.last_fencing_token, p.workloads, p.ceilings,
        p.reserved, p.priorities, p.max_concurrent, p.max_queued, p.lease_ttl_ms,
        array_fill(0, ARRAY[cardinality(p.workloads)]),
        array_fill(0, ARRAY[cardinality(p.workloads)]), p.name
    FROM runcell_limiter p
    WHERE p.name = v_parent AND p.parent IS NULL
      AND coalesce((p.config->>'keyed')::boolean, false)
    ON CONFLICT (name) DO NOTHING;
    IF NOT FOUND THEN
        RETURN EXISTS (SELECT 1 FROM runcell_limiter WHERE name = p_name);
    END IF;
    UPDATE runcell_limiter k SET last_fencing_token = greatest(k.last_fencing_token,
                                                              p.last_fencing_token)
    FROM runcell_limiter p WHERE k.name = p_name AND p.name = v_parent;
    RETURN true;
END;
$$;

-- Delete up to p_limit keys of a keyed limiter that are idle: no slot held, nobody
-- waiting or parked (the kept counts, checked again on the locked row), no lease or
-- expired parked request left. Keys in use are skipped, never waited for (SKIP
-- LOCKED): an operation holding a key's row is never delayed by a purge. Returns how
-- many went. Asynchronous commit: a purge lost in a crash is simply done again.
CREATE OR REPLACE FUNCTION runcell_purge_idle_keys(p_parent text, p_limit integer)
RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
    v_floor bigint;
    v_gone integer;
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    WITH idle AS (
        SELECT k.name FROM runcell_limiter k
        WHERE k.parent = p_parent AND 0 = ALL(k.active) AND 0 = ALL(k.waiting)
          AND NOT EXISTS (SELECT 1 FROM runcell_lease l WHERE l.limiter = k.name)
          AND k.name NOT IN (SELECT q.limiter FROM runcell_queue q
                             WHERE q.expired_at IS NOT NULL)
        LIMIT p_limit
        FOR UPDATE OF k SKIP LOCKED
    ), gone AS (
        DELETE FROM runcell_limiter k USING idle WHERE k.name = idle.name
        RETURNING k.last_fencing_token
    )
    SELECT max(last_fencing_token), count(*) INTO v_floor, v_gone FROM gone;
    IF v_gone > 0 THEN
        UPDATE runcell_limiter SET last_fencing_token = greatest(last_fencing_token, v_floor)
        WHERE name = p_parent;
    END IF;
    RETURN v_gone;
END;
$$;

-- The keyed limiter's limits were stored again (registered or replaced): its keys
-- take them too. Idle keys are simply deleted (they come back with the new limits);
-- keys in use get the new limits and their counts recounted from their rows.
CREATE OR REPLACE FUNCTION runcell_sync_keys(p_parent text) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    v_name text;
    v_synced integer := 0;
BEGIN
    PERFORM runcell_purge_idle_keys(p_parent, 2147483647);
    PERFORM set_config('synchronous_commit', 'on', true);  -- the purge's choice, not ours
    FOR v_name IN
        UPDATE runcell_limiter k SET config = p.config, config_hash = p.config_hash,
            updated_at = clock_timestamp()
        FROM runcell_limiter p
        WHERE p.name = p_parent AND k.parent = p_parent AND k.config_hash <> p.config_hash
        RETURNING k.name
    LOOP
        PERFORM runcell_set_limits(v_name);
        v_synced := v_synced + 1;
    END LOOP;
    RETURN v_synced;
END;
$$;

-- Lock the limiter row, waiting at most p_lock_timeout_ms: a frozen or partitioned
-- process that holds it delays others by at most the time they may wait anyway.
CREATE OR REPLACE FUNCTION runcell_lock(
    p_limiter text, p_config_hash text, p_lock_timeout_ms integer
) RETURNS runcell_limiter LANGUAGE plpgsql AS $$
DECLARE
    v_row runcell_limiter;
BEGIN
    PERFORM set_config('lock_timeout', greatest(1, p_lock_timeout_ms)::text || 'ms', true);
    SELECT * INTO v_row FROM runcell_limiter WHERE name = p_limiter FOR UPDATE;
    IF NOT FOUND THEN
        -- A key of a keyed limiter appears on first use (IF does not reset FOUND: it
        -- stays false unless the second SELECT finds the row).
        IF runcell_create_key(p_limiter) THEN
            SELECT * INTO v_row FROM runcell_limiter WHERE name = p_limiter FOR UPDATE;
        END IF;
        IF NOT FOUND THEN
            RAISE EXCEPTION 'runcell: limiter % is not registered', p_limiter
                USING ERRCODE = 'RC001';
        END IF;
    END IF;
    IF p_config_hash IS NOT NULL AND v_row.config_hash <> p_config_hash THEN
        RAISE EXCEPTION 'runcell: the limits of limiter % were replaced', p_limiter
            USING ERRCODE = 'RC002';
    END IF;
    RETURN v_row;
END;
$$;

-- Acquire: one round trip, for a request over p_limiters (its members, in lock order).
-- With one member (the fast path): grants the caller at once when nobody of its workload
-- waits and the workload has room (allocation is settled after every transaction, so
-- no other waiter could use that slot): one synchronous commit. Otherwise queues it
-- for its process to be told, with an asynchronous commit (a queue row lost in a
-- crash is found missing by its process's safety poll, which queues it again; any
-- grant's synchronous commit flushes it first). p_retry: the request may exist
-- already (a retry after a lost reply, a redelivered deferral): return what it has.
-- Returns {"s": "granted", "lease": [lease_id, token]} | {"s": "queued", "left_ms"}
-- | {"s": "no-wait"} | {"s": "queue-full"} | {"s": "duplicate"} | {"s": "unknown-workload"},
-- each with "now", the database's clock (epoch seconds), and "parked": lease ids
-- granted to parked requests by this call. A new queued request's answer also says
-- what its wait is likely to be, from the row already locked (no extra read): "ahead"
-- (requests of its workload in line before it: the kept count), "hold_ms" (the mean
-- hold, NULL before any release) and "slots" (its workload's ceiling, at most the
-- limiter's).
-- With several members: one slot in each of the limiters, together or not at all.
-- p_limiters in lock order (sorted, distinct), each with its stored limits' checksum and
-- the workload the request uses there. Granted at once when, in every limiter, nobody
-- of its workload waits and the workload has room (one synchronous commit); otherwise
-- one queue row per limiter (member "<request id>|<limiter>", asynchronous commit),
-- granted later all together by runcell_grant_request. Nothing is held while it
-- waits. Returns {"s": "granted", "leases": [[lease_id, token], ...] in p_limiters'
-- order} | {"s": "queued", "left_ms"} | {"s": "no-wait"} | {"s": "queue-full", "limiter"}
-- | {"s": "unknown-workload", "limiter"} | {"s": "duplicate"} (p_retry: it was parked and
-- granted, see runcell_park), each with "now".
CREATE OR REPLACE FUNCTION runcell_acquire(
    p_limiters text[],
    p_hashes text[],
    p_workloads text[],
    p_request jsonb,
    p_wait_ms double precision,
    p_process jsonb,
    p_lock_timeout_ms integer,
    p_retry boolean
) RETURNS jsonb LANGUAGE plpgsql AS $$
BEGIN
    IF cardinality(p_limiters) = 1 THEN
        -- One member: the fast path (one limiter row locked; its rows are named
        -- by the request id itself).
        DECLARE
            v_limiter text := p_limiters[1];
            v_now timestamptz;
            v_row runcell_limiter;
            v_request_id text := p_request->>'request_id';
            v_workload text := coalesce(p_workloads[1], p_request->>'workload');
            v_i integer;
            v_found record;
            v_lease_id uuid;
            v_result record;
            v_requests text[] := '{}';
            v_leases uuid[];
            v_tokens bigint[];
            v_parked boolean[];
            v_mine integer;
            v_first_expiry timestamptz;
            v_j integer;
            v_queued integer := 0;
            v_ahead integer;
        BEGIN
            v_row := runcell_lock(v_limiter, p_hashes[1], p_lock_timeout_ms);
            v_now := clock_timestamp();
            v_i := array_position(v_row.workloads, v_workload);
            IF v_i IS NULL THEN
                RETURN jsonb_build_object('s', 'unknown-workload', 'limiter', v_limiter, 'now', extract(epoch FROM v_now));
            END IF;
            IF p_retry THEN
                SELECT lease_id, fencing_token, parked INTO v_found FROM runcell_lease
                WHERE request_id = v_request_id AND limiter = v_limiter;
                IF FOUND THEN
                    RETURN runcell_answer(
                        CASE WHEN v_found.parked THEN 'duplicate' ELSE 'granted' END, v_now,
                        v_found.lease_id, v_found.fencing_token);
                END IF;
                SELECT deadline INTO v_found FROM runcell_queue
                WHERE request_id = v_request_id AND limiter = v_limiter;
                IF FOUND THEN
                    RETURN jsonb_build_object('s', 'queued', 'now', extract(epoch FROM v_now),
                        'left_ms', extract(epoch FROM v_found.deadline - v_now) * 1000);
                END IF;
            END IF;

            IF v_row.waiting[v_i] <= 0
               AND runcell_has_room(v_row.active, v_row.ceilings, v_row.reserved,
                                       v_row.max_concurrent, v_i) THEN
                INSERT INTO runcell_lease (limiter, workload, request_id, fencing_token, run_id,
                    root_run_id, parent_run_id, holder_name, holder_host, holder_pid, ttl_ms,
                    acquired_at, renewed_at, expires_at)
                VALUES (v_limiter, v_workload, v_request_id, v_row.last_fencing_token + 1,
                    p_request->>'run_id', p_request->>'root_run_id', p_request->>'parent_run_id',
                    p_request->>'holder_name', p_process->>'host', (p_process->>'pid')::integer,
                    v_row.lease_ttl_ms, v_now, v_now, v_now + v_row.lease_ttl_ms * interval '1 millisecond')
                RETURNING lease_id INTO v_lease_id;
                UPDATE runcell_limiter
                SET last_fencing_token = last_fencing_token + 1, active[v_i] = active[v_i] + 1
                WHERE name = v_limiter;
                IF (v_row.config->>'fairness') IS NOT DISTINCT FROM 'round_robin' THEN
                    PERFORM runcell_fair_granted(v_limiter, p_request->>'key',
                                                    v_row.last_fencing_token + 1);
                END IF;
                RETURN runcell_answer('granted', v_now, v_lease_id, v_row.last_fencing_token + 1);
            END IF;

            IF p_wait_ms IS NOT NULL AND p_wait_ms <= 0 THEN
                RETURN jsonb_build_object('s', 'no-wait', 'now', extract(epoch FROM v_now));
            END IF;
            IF v_row.max_queued IS NOT NULL THEN
                FOR v_j IN 1 .. array_length(v_row.waiting, 1) LOOP
                    v_queued := v_queued + v_row.waiting[v_j];
                END LOOP;
                IF v_queued >= v_row.max_queued THEN
                    RETURN jsonb_build_object('s', 'queue-full', 'limiter', v_limiter, 'now', extract(epoch FROM v_now));
                END IF;
            END IF;

            -- The waiting process must be known alive for its row to be granted: its row is
            -- written when missing or past half its time (read first: a write per enqueue
            -- would lengthen every contended acquire).
            PERFORM 1 FROM runcell_process p
            WHERE p.process_id = p_process->>'process_id'
              AND p.expires_at >= v_now + (p_process->>'ttl_ms')::integer * interval '1 millisecond' / 2;
            IF NOT FOUND THEN
                INSERT INTO runcell_process AS p (process_id, channel, host, pid, expires_at)
                VALUES (p_process->>'process_id', p_process->>'channel', p_process->>'host',
                        (p_process->>'pid')::integer,
                        v_now + (p_process->>'ttl_ms')::integer * interval '1 millisecond')
                ON CONFLICT (process_id) DO UPDATE SET expires_at = EXCLUDED.expires_at;
            END IF;

            v_ahead := v_row.waiting[v_i];
            INSERT INTO runcell_queue (request_id, limiter, workload, run_id, root_run_id,
                parent_run_id, holder_name, holder_host, holder_pid, enqueued_at, deadline,
                expires_at, in_progress, process_id, fair_key)
            VALUES (v_request_id, v_limiter, v_workload, p_request->>'run_id',
                p_request->>'root_run_id', p_request->>'parent_run_id', p_request->>'holder_name',
                p_process->>'host', (p_process->>'pid')::integer, v_now,
                v_now + p_wait_ms * interval '1 millisecond', 'infinity',
                coalesce((p_request->>'in_progress')::boolean, false), p_process->>'process_id',
                p_request->>'key');
            v_row.waiting[v_i] := v_row.waiting[v_i] + 1;

            -- When the first lease of this limiter expires unless renewed. Already passed: its
            -- holder died, and its slot comes back here (bounded), off the uncontended path.
            -- Still to come: the waiting process looks then.
            SELECT l.expires_at INTO v_first_expiry FROM runcell_lease l
            WHERE l.limiter = v_limiter ORDER BY l.expires_at LIMIT 1;
            -- Room with others of its workload ahead: they are requests over several limiters
            -- waiting elsewhere (which hold up nobody), so allocation runs here, now.
            IF v_first_expiry <= v_now
               OR runcell_has_room(v_row.active, v_row.ceilings, v_row.reserved,
                                      v_row.max_concurrent, v_i) THEN
                IF v_first_expiry <= v_now THEN
                    v_result := runcell_drop_expired_leases(v_row, v_now, 100);
                    v_row := v_result.p_row;
                END IF;
                v_result := runcell_allocate(v_row, v_now, v_request_id);
                v_row := v_result.p_row;
                v_requests := v_result.requests;
                v_leases := v_result.leases;
                v_tokens := v_result.tokens;
                v_parked := v_result.parked;
                v_mine := array_position(v_requests, v_request_id);
                SELECT l.expires_at INTO v_first_expiry FROM runcell_lease l
                WHERE l.limiter = v_limiter AND l.expires_at > v_now ORDER BY l.expires_at LIMIT 1;
            END IF;
            UPDATE runcell_limiter
            SET active = v_row.active, waiting = v_row.waiting,
                last_fencing_token = v_row.last_fencing_token
            WHERE name = v_limiter;
            IF v_mine IS NOT NULL THEN
                RETURN runcell_due_groups(
                    runcell_answer('granted', v_now, v_leases[v_mine], v_tokens[v_mine])
                    || jsonb_build_object('parked', runcell_parked_leases(v_leases, v_parked)));
            END IF;
            IF cardinality(v_requests) = 0 THEN
                PERFORM set_config('synchronous_commit', 'off', true);
                RETURN runcell_due_groups(jsonb_build_object('s', 'queued',
                    'now', extract(epoch FROM v_now),
                    'left_ms', p_wait_ms, 'expiry_ms', extract(epoch FROM v_first_expiry - v_now) * 1000,
                    'ahead', v_ahead, 'hold_ms', v_row.hold_ms_avg,
                    'slots', least(v_row.ceilings[v_i], v_row.max_concurrent)));
            END IF;
            RETURN runcell_due_groups(jsonb_build_object('s', 'queued', 'now', extract(epoch FROM v_now),
                'left_ms', p_wait_ms,
                'parked', runcell_parked_leases(v_leases, v_parked),
                'expiry_ms', extract(epoch FROM v_first_expiry - v_now) * 1000,
                'ahead', v_ahead, 'hold_ms', v_row.hold_ms_avg,
                'slots', least(v_row.ceilings[v_i], v_row.max_concurrent)));
        END;
    END IF;
    -- Several members: each waits as a row of its own, "<request id>|<limiter>".
    DECLARE
        v_n integer := cardinality(p_limiters);
        v_rows runcell_limiter[] := '{}';
        v_row runcell_limiter;
        v_w integer[] := '{}';
        v_now timestamptz;
        v_group text := p_request->>'request_id';
        v_member text;
        v_i integer;
        v_j integer;
        v_all boolean := true;
        v_leases jsonb := '[]'::jsonb;
        v_lease_id uuid;
        v_token bigint;
        v_queued integer;
        v_held jsonb;
    BEGIN
        FOR v_i IN 1 .. v_n LOOP
            -- Byte-wise (C), as the client sorts them, whatever the database's collation.
            IF v_i > 1 AND p_limiters[v_i] COLLATE "C" <= p_limiters[v_i - 1] THEN
                RAISE EXCEPTION 'runcell: limiters must be distinct and in lock order: %', p_limiters;
            END IF;
            v_rows := v_rows || runcell_lock(p_limiters[v_i], p_hashes[v_i], p_lock_timeout_ms);
        END LOOP;
        v_now := clock_timestamp();
        FOR v_i IN 1 .. v_n LOOP
            v_j := array_position(v_rows[v_i].workloads, p_workloads[v_i]);
            IF v_j IS NULL THEN
                RETURN jsonb_build_object('s', 'unknown-workload', 'limiter', p_limiters[v_i],
                                          'now', extract(epoch FROM v_now));
            END IF;
            v_w := v_w || v_j;
        END LOOP;
        IF p_retry THEN
            -- A grant made to the request while it was parked belongs to its parked
            -- message's publication, never to a delivery asking again with its id.
            IF EXISTS (SELECT 1 FROM runcell_lease x
                       WHERE x.request_id IN (SELECT v_group || '|' || l FROM unnest(p_limiters) AS l)
                         AND x.parked) THEN
                RETURN jsonb_build_object('s', 'duplicate', 'now', extract(epoch FROM v_now));
            END IF;
            v_held := runcell_group_leases(v_group, p_limiters);
            IF v_held IS NOT NULL THEN
                RETURN jsonb_build_object('s', 'granted', 'now', extract(epoch FROM v_now),
                                          'leases', v_held);
            END IF;
            SELECT count(*) INTO v_queued FROM runcell_queue
            WHERE group_id = v_group AND granted_lease_id IS NULL;
            IF v_queued = v_n THEN
                RETURN jsonb_build_object('s', 'queued', 'now', extract(epoch FROM v_now),
                                          'left_ms', p_wait_ms);
            END IF;
            -- Part of it is gone (a member dropped while its process stood still): what is
            -- left could never be granted. Take it out and ask afresh.
            FOR v_i IN 1 .. v_n LOOP
                DELETE FROM runcell_queue
                WHERE request_id = v_group || '|' || p_limiters[v_i] AND granted_lease_id IS NULL;
                IF FOUND THEN
                    v_row := v_rows[v_i];
                    v_row.waiting[v_w[v_i]] := greatest(0, v_row.waiting[v_w[v_i]] - 1);
                    v_rows[v_i] := v_row;
                    UPDATE runcell_limiter SET waiting[v_w[v_i]] = greatest(0, waiting[v_w[v_i]] - 1)
                    WHERE name = p_limiters[v_i];
                END IF;
            END LOOP;
        END IF;
        FOR v_i IN 1 .. v_n LOOP
            v_row := v_rows[v_i];
            IF v_row.waiting[v_w[v_i]] > 0
               OR NOT runcell_has_room(v_row.active, v_row.ceilings, v_row.reserved,
                                          v_row.max_concurrent, v_w[v_i]) THEN
                v_all := false;
            END IF;
        END LOOP;
        IF v_all THEN
            FOR v_i IN 1 .. v_n LOOP
                v_row := v_rows[v_i];
                v_token := v_row.last_fencing_token + 1;
                INSERT INTO runcell_lease (limiter, workload, request_id, fencing_token, run_id,
                    root_run_id, parent_run_id, holder_name, holder_host, holder_pid, ttl_ms,
                    acquired_at, renewed_at, expires_at)
                VALUES (p_limiters[v_i], p_workloads[v_i], v_group || '|' || p_limiters[v_i],
                    v_token, p_request->>'run_id', p_request->>'root_run_id',
                    p_request->>'parent_run_id', p_request->>'holder_name', p_process->>'host',
                    (p_process->>'pid')::integer, v_row.lease_ttl_ms, v_now, v_now,
                    v_now + v_row.lease_ttl_ms * interval '1 millisecond')
                RETURNING lease_id INTO v_lease_id;
                UPDATE runcell_limiter
                SET last_fencing_token = v_token, active[v_w[v_i]] = active[v_w[v_i]] + 1
                WHERE name = p_limiters[v_i];
                IF (v_row.config->>'fairness') IS NOT DISTINCT FROM 'round_robin' THEN
                    PERFORM runcell_fair_granted(p_limiters[v_i], p_request->>'key', v_token);
                END IF;
                v_leases := v_leases || jsonb_build_array(jsonb_build_array(v_lease_id, v_token));
            END LOOP;
            RETURN jsonb_build_object('s', 'granted', 'now', extract(epoch FROM v_now),
                                      'leases', v_leases);
        END IF;
        IF p_wait_ms IS NOT NULL AND p_wait_ms <= 0 THEN
            RETURN jsonb_build_object('s', 'no-wait', 'now', extract(epoch FROM v_now));
        END IF;
        FOR v_i IN 1 .. v_n LOOP
            v_row := v_rows[v_i];
            IF v_row.max_queued IS NOT NULL THEN
                SELECT coalesce(sum(x), 0) INTO v_queued FROM unnest(v_row.waiting) AS x;
                IF v_queued >= v_row.max_queued THEN
                    RETURN jsonb_build_object('s', 'queue-full', 'limiter', p_limiters[v_i],
                                              'now', extract(epoch FROM v_now));
                END IF;
            END IF;
        END LOOP;
        INSERT INTO runcell_process AS p (process_id, channel, host, pid, expires_at)
        VALUES (p_process->>'process_id', p_process->>'channel', p_process->>'host',
                (p_process->>'pid')::integer,
                v_now + (p_process->>'ttl_ms')::integer * interval '1 millisecond')
        ON CONFLICT (process_id) DO UPDATE SET expires_at = EXCLUDED.expires_at;
        FOR v_i IN 1 .. v_n LOOP
            INSERT INTO runcell_queue (request_id, limiter, workload, run_id, root_run_id,
                parent_run_id, holder_name, holder_host, holder_pid, enqueued_at, deadline,
                expires_at, in_progress, process_id, fair_key, group_id, group_limiters)
            VALUES (v_group || '|' || p_limiters[v_i], p_limiters[v_i], p_workloads[v_i],
                p_request->>'run_id', p_request->>'root_run_id', p_request->>'parent_run_id',
                p_request->>'holder_name', p_process->>'host', (p_process->>'pid')::integer,
                v_now, v_now + p_wait_ms * interval '1 millisecond', 'infinity',
                coalesce((p_request->>'in_progress')::boolean, false),
                p_process->>'process_id', p_request->>'key', v_group, p_limiters);
            UPDATE runcell_limiter SET waiting[v_w[v_i]] = waiting[v_w[v_i]] + 1
            WHERE name = p_limiters[v_i];
        END LOOP;
        PERFORM set_config('synchronous_commit', 'off', true);
        RETURN jsonb_build_object('s', 'queued', 'now', extract(epoch FROM v_now),
                                  'left_ms', p_wait_ms);
    END;
END;
$$;

-- Release: one round trip. Frees the slot and grants the next waiters in the same
-- transaction, telling their processes directly. With nobody granted the commit is
-- asynchronous (a release lost in a crash only keeps its slot until the lease
-- expires: it fails closed); a commit that grants stays synchronous.
-- Returns {"t": grant time (epoch s), "g": [[request_id, lease_id, token], ...] (the
-- waiters granted: the caller wakes its own at once, before their notification
-- arrives), "parked": [lease_id, ...] (grants to parked requests, to re-publish)}.
-- The same update that writes the counts back folds this lease's hold (acquired_at
-- to now) into the limiter's mean hold time (hold_ms_avg, weight 0.2 for the newest),
-- which queued acquires report: no extra statement, no extra row touched.
CREATE OR REPLACE FUNCTION runcell_release(
    p_limiter text, p_lease_id uuid, p_lock_timeout_ms integer
) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_row runcell_limiter;
    v_workload text;
    v_i integer;
    v_now timestamptz;
    v_result record;
    v_granted integer := 0;
    v_acquired_at timestamptz;
    v_held_ms double precision;
BEGIN
    v_row := runcell_lock(p_limiter, NULL, p_lock_timeout_ms);
    -- "limiter || ''": found by its primary key whatever the statistics say (with
    -- statistics taken while the table was empty, the planner would otherwise pick
    -- the (limiter, expires_at) index and read every lease of the limiter).
    DELETE FROM runcell_lease WHERE lease_id = p_lease_id AND limiter || '' = p_limiter
    RETURNING workload, acquired_at INTO v_workload, v_acquired_at;
    v_i := array_position(v_row.workloads, v_workload);
    IF v_i IS NULL THEN
        PERFORM set_config('synchronous_commit', 'off', true);
        RETURN '{}'::jsonb;
    END IF;
    v_row.active[v_i] := greatest(0, v_row.active[v_i] - 1);
    v_now := clock_timestamp();
    v_held_ms := greatest(0, extract(epoch FROM v_now - v_acquired_at) * 1000);
    IF 0 < ANY(v_row.waiting) THEN
        v_result := runcell_allocate(v_row, v_now, NULL);
        v_row := v_result.p_row;
        v_granted := cardinality(v_result.requests);
    END IF;
    UPDATE runcell_limiter
    SET active = v_row.active, waiting = v_row.waiting,
        last_fencing_token = v_row.last_fencing_token,
        hold_ms_avg = CASE WHEN hold_ms_avg IS NULL THEN v_held_ms
                           ELSE hold_ms_avg + 0.2 * (v_held_ms - hold_ms_avg) END
    WHERE name = p_limiter;
    IF v_granted = 0 THEN
        PERFORM set_config('synchronous_commit', 'off', true);
        RETURN runcell_due_groups('{}'::jsonb);
    END IF;
    RETURN runcell_due_groups(jsonb_build_object(
        't', extract(epoch FROM v_now),
        'g', (SELECT jsonb_agg(jsonb_build_array(r, l::text, t) ORDER BY o)
              FROM unnest(v_result.requests, v_result.leases, v_result.tokens, v_result.parked)
                   WITH ORDINALITY AS g(r, l, t, pk, o)
              WHERE NOT pk),
        'parked', runcell_parked_leases(v_result.leases, v_result.parked)));
END;
$$;

-- p_answer with "grp": the requests over several limiters this transaction's
-- allocation found first in line everywhere (runcell.due_groups), for the caller to run
-- their group pass (runcell_grant_request) next.
CREATE OR REPLACE FUNCTION runcell_due_groups(p_answer jsonb) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
    v_due text := nullif(current_setting('runcell.due_groups', true), '');
BEGIN
    IF v_due IS NULL THEN
        RETURN p_answer;
    END IF;
    PERFORM set_config('runcell.due_groups', '', true);
    RETURN p_answer || jsonb_build_object('grp', (
        SELECT jsonb_agg(DISTINCT g) FROM unnest(string_to_array(v_due, E'\n')) AS g
        WHERE g <> ''));
END;
$$;

-- The leases a request over several limiters holds, [[lease_id, token], ...] in
-- p_limiters' order, or NULL unless it holds one in every limiter.
CREATE OR REPLACE FUNCTION runcell_group_leases(p_group text, p_limiters text[])
RETURNS jsonb LANGUAGE sql STABLE AS $$
    SELECT CASE WHEN count(x.lease_id) = cardinality(p_limiters)
                THEN jsonb_agg(jsonb_build_array(x.lease_id, x.fencing_token) ORDER BY u.o)
           END
    FROM unnest(p_limiters) WITH ORDINALITY AS u(l, o)
    LEFT JOIN runcell_lease x ON x.request_id = p_group || '|' || u.l
$$;

-- Whether member p_member (workload index p_j) of a request over several limiters may
-- take a slot of limiter p_row now, as far as this limiter goes (under its lock): no
-- request over one limiter waits ahead of it in its workload's line (it would be served
-- first), and its workload has room once the slots of the requests over several
-- limiters ahead of it that hold their place (runcell_group_holds_place) are set aside.
CREATE OR REPLACE FUNCTION runcell_group_may_take(
    p_row runcell_limiter, p_j integer, p_member text, p_now timestamptz
) RETURNS boolean LANGUAGE plpgsql STABLE AS $$
DECLARE
    v_position bigint;
    v_ahead record;
    v_k integer;
    v_active integer[] := p_row.active;
BEGIN
    SELECT q.position INTO v_position FROM runcell_queue q WHERE q.request_id = p_member;
    IF NOT FOUND OR runcell_single_ahead(p_member, p_now) THEN
        RETURN false;
    END IF;
    FOR v_ahead IN
        SELECT q.workload, q.group_id, q.group_limiters, q.enqueued_at FROM runcell_queue q
        WHERE q.limiter = p_row.name AND q.group_id IS NOT NULL
          AND q.request_id <> p_member AND q.granted_lease_id IS NULL
          AND q.expired_at IS NULL AND (q.deadline IS NULL OR q.deadline > p_now)
          AND q.position < v_position
        ORDER BY q.position
        LIMIT 20
    LOOP
        v_k := array_position(p_row.workloads, v_ahead.workload);
        IF v_k IS NOT NULL
           AND runcell_group_holds_place(v_ahead.group_id, v_ahead.group_limiters, p_row.name,
                                         v_ahead.enqueued_at, p_now) THEN
            v_active[v_k] := v_active[v_k] + 1;
        END IF;
    END LOOP;
    RETURN runcell_has_room(v_active, p_row.ceilings, p_row.reserved, p_row.max_concurrent,
                            p_j);
END;
$$;

-- The group pass of a request over several limiters: lock its limiters in order, and
-- grant it a slot in each if, in every one, it may take one (runcell_group_may_take)
-- and no workload of higher priority waits with room. Runs when an allocation set its
-- slot aside (the releaser is told, "grp"), right after it queues, and
-- from the waiting process now and then (for a parked request, from the sweepers).
-- Returns {} or {"t": grant time, "g": [[member, lease_id, token], ...]}; the waiting
-- process is notified. A parked request is granted as one parked request is: its
-- answer is {"t", "g": [], "parked": [the first member's lease id]}, the message to
-- re-publish.
CREATE OR REPLACE FUNCTION runcell_grant_request(p_group text, p_lock_timeout_ms integer)
RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_limiters text[];
    v_n integer;
    v_rows runcell_limiter[] := '{}';
    v_row runcell_limiter;
    v_w integer[] := '{}';
    v_now timestamptz;
    v_member text;
    v_m record;
    v_i integer;
    v_j integer;
    v_members text[] := '{}';
    v_leases uuid[] := '{}';
    v_tokens bigint[] := '{}';
    v_channels text[] := '{}';
    v_channel text;
    v_keys text[] := '{}';
    v_lease_id uuid;
    v_reaped record;
    v_parked boolean;
BEGIN
    SELECT group_limiters INTO v_limiters FROM runcell_queue WHERE group_id = p_group LIMIT 1;
    IF NOT FOUND THEN
        PERFORM set_config('synchronous_commit', 'off', true);
        RETURN '{}'::jsonb;
    END IF;
    v_n := cardinality(v_limiters);
    FOR v_i IN 1 .. v_n LOOP
        v_rows := v_rows || runcell_lock(v_limiters[v_i], NULL, p_lock_timeout_ms);
    END LOOP;
    v_now := clock_timestamp();
    FOR v_i IN 1 .. v_n LOOP
        -- A dead holder's slot comes back here too: the waiting process's own pass
        -- then needs nobody else to reap it.
        v_reaped := runcell_drop_expired_leases(v_rows[v_i], v_now, 100);
        IF v_reaped.reaped > 0 THEN
            v_rows[v_i] := v_reaped.p_row;
            PERFORM runcell_store_counts(v_rows[v_i]);
        END IF;
    END LOOP;
    FOR v_i IN 1 .. v_n LOOP
        v_row := v_rows[v_i];
        v_member := p_group || '|' || v_limiters[v_i];
        SELECT q.workload, q.granted_lease_id, q.deadline, p.channel, q.fair_key, q.parked
        INTO v_m
        FROM runcell_queue q
        LEFT JOIN runcell_process p ON p.process_id = q.process_id AND p.expires_at > v_now
        WHERE q.request_id = v_member;
        IF NOT FOUND OR v_m.granted_lease_id IS NOT NULL
           OR (v_m.deadline IS NOT NULL AND v_m.deadline <= v_now) THEN
            PERFORM set_config('synchronous_commit', 'off', true);
            RETURN '{}'::jsonb;
        END IF;
        v_j := array_position(v_row.workloads, v_m.workload);
        IF v_j IS NULL
           OR NOT runcell_group_may_take(v_row, v_j, v_member, v_now)
           OR EXISTS (SELECT 1 FROM generate_subscripts(v_row.workloads, 1) AS k
                      WHERE k <> v_j AND v_row.waiting[k] > 0
                        AND v_row.priorities[k] > v_row.priorities[v_j]
                        AND runcell_has_room(v_row.active, v_row.ceilings, v_row.reserved,
                                                v_row.max_concurrent, k)) THEN
            PERFORM set_config('synchronous_commit', 'off', true);
            RETURN '{}'::jsonb;
        END IF;
        v_w := v_w || v_j;
        v_keys := v_keys || v_m.fair_key;
        -- Parked (runcell_park) as a whole: the first member says for all.
        v_parked := coalesce(v_parked, v_m.parked);
        v_channel := coalesce(v_channel, v_m.channel);
    END LOOP;
    FOR v_i IN 1 .. v_n LOOP
        v_row := v_rows[v_i];
        v_member := p_group || '|' || v_limiters[v_i];
        IF v_parked THEN
            -- As for one parked request (runcell_allocate): each lease is held for the
            -- claim window of its limiter, and the rows stay until the re-published task
            -- claims them all (runcell_claim). Only the first member
            -- carries the task message; the others count as published already, so the
            -- request is re-published once.
            INSERT INTO runcell_lease (limiter, workload, request_id, fencing_token, run_id,
                root_run_id, parent_run_id, holder_name, holder_host, holder_pid, ttl_ms,
                acquired_at, renewed_at, expires_at, parked)
            SELECT v_row.name, q.workload, q.request_id, v_row.last_fencing_token + 1,
                q.run_id, q.root_run_id, q.parent_run_id, q.holder_name, q.holder_host,
                q.holder_pid, v_row.lease_ttl_ms, v_now, v_now,
                v_now + least(coalesce((v_row.config->>'claim_window_ms')::integer, 5000),
                              v_row.lease_ttl_ms) * interval '1 millisecond', true
            FROM runcell_queue q WHERE q.request_id = v_member
            RETURNING lease_id INTO v_lease_id;
            UPDATE runcell_queue
            SET granted_lease_id = v_lease_id, granted_at = v_now,
                published_at = CASE WHEN v_i > 1 THEN v_now END
            WHERE request_id = v_member;
        ELSE
            WITH granted AS (DELETE FROM runcell_queue WHERE request_id = v_member RETURNING *)
            INSERT INTO runcell_lease (limiter, workload, request_id, fencing_token, run_id,
                root_run_id, parent_run_id, holder_name, holder_host, holder_pid, ttl_ms,
                acquired_at, renewed_at, expires_at, parked)
            SELECT v_row.name, g.workload, g.request_id, v_row.last_fencing_token + 1,
                g.run_id, g.root_run_id, g.parent_run_id, g.holder_name, g.holder_host,
                g.holder_pid, v_row.lease_ttl_ms, v_now, v_now,
                v_now + v_row.lease_ttl_ms * interval '1 millisecond', false
            FROM granted g
            RETURNING lease_id INTO v_lease_id;
        END IF;
        UPDATE runcell_limiter
        SET last_fencing_token = last_fencing_token + 1,
            active[v_w[v_i]] = active[v_w[v_i]] + 1,
            waiting[v_w[v_i]] = greatest(0, waiting[v_w[v_i]] - 1)
        WHERE name = v_row.name;
        IF (v_row.config->>'fairness') IS NOT DISTINCT FROM 'round_robin' THEN
            PERFORM runcell_fair_granted(v_row.name, v_keys[v_i], v_row.last_fencing_token + 1);
        END IF;
        v_members := v_members || v_member;
        v_leases := v_leases || v_lease_id;
        v_tokens := v_tokens || (v_row.last_fencing_token + 1);
        v_channels := v_channels || v_channel;
    END LOOP;
    IF v_parked THEN
        -- The publishers hear of the first member only: its message is the request's.
        PERFORM runcell_notify_grants(v_limiters[1], v_now, v_members[1:1],
            v_leases[1:1], v_tokens[1:1], ARRAY[true], ARRAY[NULL::text]);
        RETURN jsonb_build_object('t', extract(epoch FROM v_now), 'g', '[]'::jsonb,
                                  'parked', jsonb_build_array(v_leases[1]));
    END IF;
    PERFORM runcell_notify_grants(v_limiters[1], v_now, v_members, v_leases, v_tokens,
        array_fill(false, ARRAY[v_n]), v_channels);
    RETURN jsonb_build_object('t', extract(epoch FROM v_now),
        'g', (SELECT jsonb_agg(jsonb_build_array(m, l::text, t) ORDER BY o)
              FROM unnest(v_members, v_leases, v_tokens) WITH ORDINALITY AS g(m, l, t, o)));
END;
$$;

-- Withdraw a waiting request over p_limiters (its members; its wait ended or it was
-- cancelled). With one member: under the lock, so
-- an allocation that chose it has either committed or not started: when it was
-- granted meanwhile, p_give_back decides whether the grant wins (a wait that timed
-- out takes the slot after all) or goes back (a cancelled request never leaks a slot).
-- p_op_id (NULL: not recorded) makes a retry after a lost reply get the same answer.
-- Returns {"s": "granted", "lease": [...]} | {"s": "withdrawn", "parked": [lease ids
-- granted to parked requests]} | {"s": "missing"}.
-- With several members (WITHDRAW_GROUP passes no operation id: none recorded): under
-- the locks of all its limiters, in order. A grant made just before wins unless
-- p_give_back (then, and for a partial state, every lease of it is given back).
-- Allocation runs in each limiter afterwards, since the request may have had a slot set
-- aside. Returns {"s": "granted", "leases": [...] in lock order} | {"s": "withdrawn",
-- "parked": [...]}.
CREATE OR REPLACE FUNCTION runcell_withdraw(
    p_limiters text[], p_request_id text, p_give_back boolean, p_op_id uuid,
    p_lock_timeout_ms integer
) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_done jsonb;
BEGIN
    v_done := runcell_op_begin(p_op_id);
    IF v_done IS NOT NULL THEN
        RETURN v_done;
    END IF;
    IF cardinality(p_limiters) = 1 THEN
        -- One member: the fast path (one limiter row locked; its rows are named
        -- by the request id itself).
        DECLARE
            v_limiter text := p_limiters[1];
            v_now timestamptz;
            v_row runcell_limiter;
            v_lease record;
            v_queued record;
            v_result record;
            v_i integer;
            v_parked jsonb := '[]'::jsonb;
            v_status text := 'missing';
        BEGIN
            v_row := runcell_lock(v_limiter, NULL, p_lock_timeout_ms);
            v_now := clock_timestamp();
            -- A parked grant a re-published task picked up belongs to the delivery running
            -- with it (released by lease id), never to whoever names its request.
            SELECT lease_id, workload, fencing_token, parked INTO v_lease FROM runcell_lease
            WHERE request_id = p_request_id AND limiter = v_limiter AND picked_up_at IS NULL;
            IF FOUND AND NOT p_give_back AND NOT v_lease.parked THEN
                RETURN runcell_op_end(p_op_id,
                    runcell_answer('granted', v_now, v_lease.lease_id, v_lease.fencing_token));
            END IF;
            DELETE FROM runcell_queue WHERE request_id = p_request_id AND limiter = v_limiter
            RETURNING workload, granted_lease_id, expired_at INTO v_queued;
            IF FOUND THEN
                v_status := 'withdrawn';
                v_i := array_position(v_row.workloads, v_queued.workload);
                IF v_queued.granted_lease_id IS NULL AND v_queued.expired_at IS NULL
                   AND v_i IS NOT NULL THEN
                    v_row.waiting[v_i] := greatest(0, v_row.waiting[v_i] - 1);
                END IF;
            END IF;
            IF v_lease.lease_id IS NOT NULL THEN
                v_status := 'withdrawn';
                DELETE FROM runcell_lease WHERE lease_id = v_lease.lease_id;
                v_i := array_position(v_row.workloads, v_lease.workload);
                IF v_i IS NOT NULL THEN
                    v_row.active[v_i] := greatest(0, v_row.active[v_i] - 1);
                END IF;
                v_result := runcell_allocate(v_row, v_now, NULL);
                v_row := v_result.p_row;
                v_parked := runcell_parked_leases(v_result.leases, v_result.parked);
            END IF;
            PERFORM runcell_store_counts(v_row);
            RETURN runcell_op_end(p_op_id, jsonb_build_object('s', v_status,
                'now', extract(epoch FROM v_now), 'parked', v_parked));
        END;
    END IF;
    -- Several members: each waits as a row of its own, "<request id>|<limiter>".
    DECLARE
        v_n integer := cardinality(p_limiters);
        v_row runcell_limiter;
        v_now timestamptz;
        v_i integer;
        v_j integer;
        v_gone record;
        v_result record;
        v_held jsonb;
        v_parked jsonb := '[]'::jsonb;
    BEGIN
        FOR v_i IN 1 .. v_n LOOP
            PERFORM runcell_lock(p_limiters[v_i], NULL, p_lock_timeout_ms);
        END LOOP;
        v_now := clock_timestamp();
        v_held := runcell_group_leases(p_request_id, p_limiters);
        IF v_held IS NOT NULL AND NOT p_give_back THEN
            RETURN runcell_op_end(p_op_id, jsonb_build_object('s', 'granted',
                'now', extract(epoch FROM v_now), 'leases', v_held));
        END IF;
        FOR v_i IN 1 .. v_n LOOP
            SELECT * INTO v_row FROM runcell_limiter WHERE name = p_limiters[v_i];
            FOR v_gone IN
                DELETE FROM runcell_queue WHERE request_id = p_request_id || '|' || p_limiters[v_i]
                RETURNING workload, granted_lease_id, expired_at
            LOOP
                v_j := array_position(v_row.workloads, v_gone.workload);
                IF v_j IS NOT NULL AND v_gone.granted_lease_id IS NULL
                   AND v_gone.expired_at IS NULL THEN
                    v_row.waiting[v_j] := greatest(0, v_row.waiting[v_j] - 1);
                END IF;
            END LOOP;
            FOR v_gone IN
                DELETE FROM runcell_lease WHERE request_id = p_request_id || '|' || p_limiters[v_i]
                RETURNING workload
            LOOP
                v_j := array_position(v_row.workloads, v_gone.workload);
                IF v_j IS NOT NULL THEN
                    v_row.active[v_j] := greatest(0, v_row.active[v_j] - 1);
                END IF;
            END LOOP;
            v_result := runcell_allocate(v_row, v_now, NULL);
            v_row := v_result.p_row;
            v_parked := v_parked || runcell_parked_leases(v_result.leases, v_result.parked);
            PERFORM runcell_store_counts(v_row);
        END LOOP;
        PERFORM set_config('runcell.due_groups', '', true);
        RETURN runcell_op_end(p_op_id, jsonb_build_object('s', 'withdrawn',
            'now', extract(epoch FROM v_now), 'parked', v_parked));
    END;
END;
$$;

-- A process's safety poll for all its waiters at once (no lock): which were granted
-- (a notification may have been lost), which are gone (their rows were reaped while
-- the process stalled), and which of its limiters hold expired leases (it then runs
-- runcell_reap). With p_heartbeat it renews the process's liveness, which keeps
-- all its queue rows: one row per process, not one per waiter.
CREATE OR REPLACE FUNCTION runcell_poll(
    p_process jsonb, p_request_ids text[], p_limiters text[], p_heartbeat boolean
) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz := clock_timestamp();
BEGIN
    IF p_heartbeat THEN
        INSERT INTO runcell_process AS p (process_id, channel, host, pid, expires_at)
        VALUES (p_process->>'process_id', p_process->>'channel', p_process->>'host',
                (p_process->>'pid')::integer,
                v_now + (p_process->>'ttl_ms')::integer * interval '1 millisecond')
        ON CONFLICT (process_id) DO UPDATE SET expires_at = EXCLUDED.expires_at;
        PERFORM set_config('synchronous_commit', 'off', true);
    END IF;
    RETURN jsonb_build_object(
        'now', extract(epoch FROM v_now),
        'granted', (SELECT coalesce(jsonb_agg(jsonb_build_array(
                        l.request_id, l.lease_id, l.fencing_token,
                        extract(epoch FROM l.acquired_at))), '[]')
                    FROM runcell_lease l
                    WHERE l.request_id = ANY(p_request_ids) AND NOT l.parked),
        'missing', (SELECT coalesce(jsonb_agg(r), '[]') FROM unnest(p_request_ids) AS r
                    WHERE NOT EXISTS (SELECT 1 FROM runcell_queue q WHERE q.request_id = r)
                      AND NOT EXISTS (SELECT 1 FROM runcell_lease l WHERE l.request_id = r)),
        'reap', (SELECT coalesce(jsonb_agg(n), '[]') FROM unnest(p_limiters) AS n
                 WHERE EXISTS (SELECT 1 FROM runcell_lease l
                               WHERE l.limiter = n AND l.expires_at <= v_now)),
        -- The next moment a lease of these limiters expires unless renewed: the
        -- process polls again then, so a dead holder's slot is reaped on time.
        'next_expiry_ms', (SELECT min(extract(epoch FROM
                                   (SELECT l.expires_at FROM runcell_lease l
                                    WHERE l.limiter = n AND l.expires_at > v_now
                                    ORDER BY l.expires_at LIMIT 1) - v_now)) * 1000
                           FROM unnest(p_limiters) AS n)
    );
END;
$$;

-- An allocation pass on demand (safety poll, sweeper, force release): reap expired
-- leases and the queue rows of processes that stopped renewing (bounded), then grant.
CREATE OR REPLACE FUNCTION runcell_reap(p_limiter text, p_lock_timeout_ms integer)
RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_now timestamptz;
    v_row runcell_limiter;
    v_result record;
    v_gone record;
    v_i integer;
BEGIN
    v_row := runcell_lock(p_limiter, NULL, p_lock_timeout_ms);
    v_now := clock_timestamp();
    v_result := runcell_drop_expired_leases(v_row, v_now, 1000);
    v_row := v_result.p_row;
    FOR v_gone IN
        DELETE FROM runcell_queue WHERE request_id IN (
            SELECT q.request_id FROM runcell_queue q
            LEFT JOIN runcell_process p ON p.process_id = q.process_id
            WHERE q.limiter = p_limiter AND NOT q.parked AND q.granted_lease_id IS NULL
              AND coalesce(p.expires_at, q.expires_at) <= v_now
            LIMIT 1000)
        RETURNING workload
    LOOP
        v_i := array_position(v_row.workloads, v_gone.workload);
        IF v_i IS NOT NULL THEN
            v_row.waiting[v_i] := greatest(0, v_row.waiting[v_i] - 1);
        END IF;
    END LOOP;
    v_result := runcell_allocate(v_row, v_now, NULL);
    v_row := v_result.p_row;
    PERFORM runcell_store_counts(v_row);
    RETURN runcell_parked_leases(v_result.leases, v_result.parked);
END;
$$;

-- Renew leases of one limiter held by one process, in one statement. Asynchronous
-- commit: a renewal lost in a crash only makes the lease end sooner.
CREATE OR REPLACE FUNCTION runcell_renew(p_limiter text, p_lease_ids uuid[])
RETURNS SETOF text LANGUAGE plpgsql AS $$
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    -- statement_timestamp(): every lease renewed by one call shares the instant.
    RETURN QUERY
        UPDATE runcell_lease
        SET renewed_at = statement_timestamp(),
            expires_at = statement_timestamp() + ttl_ms * interval '1 millisecond'
        WHERE lease_id = ANY(p_lease_ids) AND limiter || '' = p_limiter  -- by primary key
          AND expires_at > clock_timestamp()
        RETURNING lease_id::text;
END;
$$;

-- Store limits in array form from their JSON (what Python's LimiterConfig.to_dict()
-- gives) and recount from the rows: used when a limiter is registered or replaced.
CREATE OR REPLACE FUNCTION runcell_set_limits(p_limiter text) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    v_config jsonb;
    v_names text[];
BEGIN
    SELECT config INTO v_config FROM runcell_limiter WHERE name = p_limiter FOR UPDATE;
    SELECT array_agg(key ORDER BY key COLLATE "C") INTO v_names
    FROM jsonb_object_keys(v_config->'workloads') AS key;
    UPDATE runcell_limiter l SET
        workloads = v_names,
        max_concurrent = (v_config->>'max_concurrent')::integer,
        max_queued = (v_config->>'max_queued')::integer,
        lease_ttl_ms = coalesce((v_config->>'lease_ttl_ms')::integer, 30000),
        ceilings = (SELECT array_agg(coalesce((v_config->'workloads'->n->>'max_concurrent')::integer,
                                              (v_config->>'max_concurrent')::integer) ORDER BY o)
                    FROM unnest(v_names) WITH ORDINALITY AS u(n, o)),
        reserved = (SELECT array_agg(coalesce((v_config->'workloads'->n->>'reserved')::integer, 0) ORDER BY o)
                    FROM unnest(v_names) WITH ORDINALITY AS u(n, o)),
        priorities = (SELECT array_agg(coalesce((v_config->'workloads'->n->>'priority')::integer, 0) ORDER BY o)
                      FROM unnest(v_names) WITH ORDINALITY AS u(n, o)),
        active = (SELECT array_agg((SELECT count(*) FROM runcell_lease x
                                    WHERE x.limiter = p_limiter AND x.workload = n)::integer ORDER BY o)
                  FROM unnest(v_names) WITH ORDINALITY AS u(n, o)),
        waiting = (SELECT array_agg((SELECT count(*) FROM runcell_queue x
                                     WHERE x.limiter = p_limiter AND x.workload = n
                                       AND x.granted_lease_id IS NULL
                                       AND x.expired_at IS NULL)::integer ORDER BY o)
                   FROM unnest(v_names) WITH ORDINALITY AS u(n, o))
    WHERE l.name = p_limiter;
END;
$$;

-- Park a waiting request over p_limiters (Celery admission deferral). With one member:
-- it keeps its place in line, but
-- no process waits for it any more; its row carries the task message to re-publish.
-- Under the limiter row's lock, like every change to who waits: an allocation that
-- read this row as waiting cannot grant it a plain lease while it is being parked.
-- p_op_id makes a retry after a lost reply get the first answer (a grant made between
-- the two attempts would otherwise read as "missing").
-- Returns {"s": "parked"} | {"s": "granted", "lease": [...]} | {"s": "missing"}.
-- p_broker: the broker its message goes back to (see runcell_queue.broker).
-- With several members: park it as one
-- request: under the locks of all its limiters, in order, every member keeps its place
-- and no process waits for it any more; the first member (p_limiters[1]) carries the
-- task message. Its group pass (run by releasers and sweepers) grants it as a parked
-- request. p_op_id makes a retry after a lost reply get the first answer.
-- Returns {"s": "parked"} | {"s": "granted", "leases": [...] in p_limiters' order} |
-- {"s": "missing"} (not all of it waits: ask again).
-- p_broker: the broker its message goes back to (see runcell_queue.broker).
CREATE OR REPLACE FUNCTION runcell_park(
    p_limiters text[], p_request_id text, p_payload jsonb, p_op_id uuid,
    p_lock_timeout_ms integer, p_broker text
) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_done jsonb;
BEGIN
    v_done := runcell_op_begin(p_op_id);
    IF v_done IS NOT NULL THEN
        RETURN v_done;
    END IF;
    IF cardinality(p_limiters) = 1 THEN
        -- One member: the fast path (one limiter row locked; its rows are named
        -- by the request id itself).
        DECLARE
            v_limiter text := p_limiters[1];
            v_now timestamptz;
            v_lease record;
            v_answer jsonb;
        BEGIN
            PERFORM runcell_lock(v_limiter, NULL, p_lock_timeout_ms);
            v_now := clock_timestamp();
            UPDATE runcell_queue SET parked = true, payload = p_payload, process_id = NULL,
                expires_at = 'infinity', broker = p_broker
            WHERE request_id = p_request_id AND limiter = v_limiter AND granted_lease_id IS NULL
              AND expired_at IS NULL;
            IF FOUND THEN
                v_answer := jsonb_build_object('s', 'parked', 'now', extract(epoch FROM v_now));
            ELSE
                SELECT lease_id, fencing_token INTO v_lease FROM runcell_lease
                WHERE request_id = p_request_id AND limiter = v_limiter AND expires_at > v_now
                  AND NOT parked;
                IF FOUND THEN
                    v_answer := runcell_answer('granted', v_now, v_lease.lease_id,
                                                  v_lease.fencing_token);
                ELSE
                    v_answer := jsonb_build_object('s', 'missing', 'now', extract(epoch FROM v_now));
                END IF;
            END IF;
            RETURN runcell_op_end(p_op_id, v_answer);
        END;
    END IF;
    -- Several members: each waits as a row of its own, "<request id>|<limiter>".
    DECLARE
        v_n integer := cardinality(p_limiters);
        v_members text[];
        v_i integer;
        v_now timestamptz;
        v_waiting integer;
        v_held jsonb;
        v_answer jsonb;
    BEGIN
        FOR v_i IN 1 .. v_n LOOP
            PERFORM runcell_lock(p_limiters[v_i], NULL, p_lock_timeout_ms);
        END LOOP;
        v_now := clock_timestamp();
        v_members := ARRAY(SELECT p_request_id || '|' || l FROM unnest(p_limiters) AS l);
        SELECT count(*) INTO v_waiting FROM runcell_queue
        WHERE request_id = ANY(v_members) AND granted_lease_id IS NULL AND expired_at IS NULL;
        IF v_waiting = v_n THEN
            UPDATE runcell_queue
            SET parked = true, process_id = NULL, expires_at = 'infinity',
                payload = CASE WHEN request_id = v_members[1] THEN p_payload END,
                broker = p_broker
            WHERE request_id = ANY(v_members);
            v_answer := jsonb_build_object('s', 'parked', 'now', extract(epoch FROM v_now));
        ELSE
            v_held := runcell_group_leases(p_request_id, p_limiters);
            IF v_held IS NOT NULL THEN
                v_answer := jsonb_build_object('s', 'granted', 'now', extract(epoch FROM v_now),
                                               'leases', v_held);
            ELSE
                v_answer := jsonb_build_object('s', 'missing', 'now', extract(epoch FROM v_now));
            END IF;
        END IF;
        RETURN runcell_op_end(p_op_id, v_answer);
    END;
END;
$$;

-- Claim: a re-published parked task takes what was granted to its parked request over
-- p_limiters. With one member: it takes the lease granted to its delivery: the queue row
-- goes and the lease is renewed to the full TTL (it was held for the claim window
-- only), marked picked up. A claim after the window ended finds the lease expired. Only the publication the grant was
-- sent as may take it (another copy of the same message finds it gone). No limiter
-- lock: the counts do not change (a granted row is not waiting; the slot is held).
-- Returns {"s": "claimed", "lease": [...], "workload"} | {"s": "stale"} (the request
-- is still stored, in line or granted to another publication: its own publication
-- will carry it) | {"s": "missing"} (claimed by another copy, withdrawn or failed).
-- "waited_ms": the request's whole wait, from its first ask (the row's enqueued_at,
-- kept across parking and re-publication) to this claim, in database time.
-- With several members: it takes the leases granted to its parked
-- request, all or none: only the publication the grant was sent as (the first
-- member's), and only while every member's lease is within its claim window. The
-- leases are locked first, as a reap locks them, then the rows go and the leases are
-- renewed to their full TTL, marked picked up. No limiter lock: no count changes.
-- Returns {"s": "claimed", "leases": [[lease_id, token, workload], ...] in p_limiters'
-- order, "waited_ms": the request's whole wait, from its first ask (the earliest
-- member's enqueued_at, kept across parking) to this claim, in database time} |
-- {"s": "stale"} (still stored: in line, or granted to another publication) |
-- {"s": "missing"} (claimed by another copy, withdrawn or failed).
CREATE OR REPLACE FUNCTION runcell_claim(
    p_limiters text[], p_request_id text, p_publication_id uuid, p_op_id uuid
) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_done jsonb;
BEGIN
    v_done := runcell_op_begin(p_op_id);
    IF v_done IS NOT NULL THEN
        RETURN v_done;
    END IF;
    IF cardinality(p_limiters) = 1 THEN
        -- One member: the fast path (one limiter row locked; its rows are named
        -- by the request id itself).
        DECLARE
            v_limiter text := p_limiters[1];
            v_now timestamptz;
            v_lease_id uuid;
            v_asked timestamptz;
            v_lease record;
            v_answer jsonb;
        BEGIN
            v_now := clock_timestamp();
            DELETE FROM runcell_queue q
            USING runcell_lease l
            WHERE q.request_id = p_request_id AND q.limiter = v_limiter AND q.parked
              AND q.publication_id = p_publication_id
              AND l.lease_id = q.granted_lease_id AND l.expires_at > v_now
            RETURNING q.granted_lease_id, q.enqueued_at INTO v_lease_id, v_asked;
            IF FOUND THEN
                UPDATE runcell_lease
                SET picked_up_at = v_now, renewed_at = v_now,
                    expires_at = v_now + ttl_ms * interval '1 millisecond'
                WHERE lease_id = v_lease_id
                RETURNING lease_id, fencing_token, workload INTO v_lease;
                v_answer := runcell_answer('claimed', v_now, v_lease.lease_id, v_lease.fencing_token)
                    || jsonb_build_object('workload', v_lease.workload,
                                          'leases', jsonb_build_array(jsonb_build_array(
                                              v_lease.lease_id, v_lease.fencing_token, v_lease.workload)),
                                          'waited_ms', extract(epoch FROM v_now - v_asked) * 1000);
            ELSIF EXISTS (SELECT 1 FROM runcell_queue
                          WHERE request_id = p_request_id AND limiter = v_limiter) THEN
                v_answer := jsonb_build_object('s', 'stale', 'now', extract(epoch FROM v_now));
            ELSE
                v_answer := jsonb_build_object('s', 'missing', 'now', extract(epoch FROM v_now));
            END IF;
            RETURN runcell_op_end(p_op_id, v_answer);
        END;
    END IF;
    -- Several members: each waits as a row of its own, "<request id>|<limiter>".
    DECLARE
        v_n integer := cardinality(p_limiters);
        v_members text[];
        v_now timestamptz;
        v_ready integer;
        v_answer jsonb;
    BEGIN
        v_now := clock_timestamp();
        v_members := ARRAY(SELECT p_request_id || '|' || l FROM unnest(p_limiters) AS l);
        PERFORM 1 FROM runcell_lease l
        WHERE l.lease_id IN (SELECT q.granted_lease_id FROM runcell_queue q
                             WHERE q.request_id = ANY(v_members))
        ORDER BY l.lease_id FOR UPDATE;
        SELECT count(*) INTO v_ready
        FROM runcell_queue q JOIN runcell_lease l ON l.lease_id = q.granted_lease_id
        WHERE q.request_id = ANY(v_members) AND q.parked AND l.expires_at > v_now
          AND EXISTS (SELECT 1 FROM runcell_queue f
                      WHERE f.request_id = v_members[1] AND f.publication_id = p_publication_id);
        IF v_ready = v_n THEN
            WITH claimed AS (
                DELETE FROM runcell_queue WHERE request_id = ANY(v_members)
                RETURNING granted_lease_id, enqueued_at
            ), renewed AS (
                UPDATE runcell_lease x
                SET picked_up_at = v_now, renewed_at = v_now,
                    expires_at = v_now + x.ttl_ms * interval '1 millisecond'
                FROM claimed c WHERE x.lease_id = c.granted_lease_id
                RETURNING x.lease_id, x.fencing_token, x.workload, x.limiter
            )
            SELECT jsonb_build_object('s', 'claimed', 'now', extract(epoch FROM v_now),
                'leases', jsonb_agg(jsonb_build_array(r.lease_id, r.fencing_token, r.workload)
                                    ORDER BY u.o),
                'waited_ms', (SELECT extract(epoch FROM v_now - min(c.enqueued_at)) * 1000
                              FROM claimed c))
            INTO v_answer
            FROM unnest(p_limiters) WITH ORDINALITY AS u(l, o) JOIN renewed r ON r.limiter = u.l;
        ELSIF EXISTS (SELECT 1 FROM runcell_queue WHERE request_id = ANY(v_members)) THEN
            v_answer := jsonb_build_object('s', 'stale', 'now', extract(epoch FROM v_now));
        ELSE
            v_answer := jsonb_build_object('s', 'missing', 'now', extract(epoch FROM v_now));
        END IF;
        RETURN runcell_op_end(p_op_id, v_answer);
    END;
END;
$$;

-- Parked requests whose deadline passed before they were granted, phase one of two:
-- each is taken out of line under its limiter's lock (expired_at; no longer counted as
-- waiting, never granted) and handed to p_taker, which records its task's failure and
-- then deletes it with runcell_complete_expired. Nothing is deleted here: a taker
-- that cannot record the failure (broker or result backend down, the process died)
-- leaves the row, and it is handed out again: to the same taker at its next pass, to
-- any other once p_retake_after_ms passed. Limiters are locked one at a time, in name
-- order. Also purges operation records older than p_keep_ops_ms (bounded). With
-- p_broker, only requests parked for that broker (or for none) are taken: another
-- broker's tasks are failed by its own workers, in its own result backend.
CREATE OR REPLACE FUNCTION runcell_take_expired_parked(
    p_taker text, p_retake_after_ms integer, p_keep_ops_ms integer, p_lock_timeout_ms integer,
    p_broker text DEFAULT NULL
) RETURNS SETOF runcell_queue LANGUAGE plpgsql AS $$
DECLARE
    v_start timestamptz := clock_timestamp();
    v_limiter text;
    v_row runcell_limiter;
    v_now timestamptz;
    v_gone runcell_queue;
    v_i integer;
BEGIN
    -- First, before any limiter row is locked (those locks last until commit).
    DELETE FROM runcell_operation WHERE op_id IN (
        SELECT op_id FROM runcell_operation
        WHERE at < v_start - p_keep_ops_ms * interval '1 millisecond'
        ORDER BY at LIMIT 1000);
    FOR v_limiter IN
        SELECT DISTINCT q.limiter FROM runcell_queue q
        WHERE q.parked AND q.granted_lease_id IS NULL AND q.expired_at IS NULL
          AND (p_broker IS NULL OR q.broker IS NULL OR q.broker = p_broker)
          AND q.deadline <= v_start
        ORDER BY q.limiter  -- lock order (COLLATE "C", as every other operation's)
    LOOP
        v_row := runcell_lock(v_limiter, NULL, p_lock_timeout_ms);
        v_now := clock_timestamp();
        FOR v_gone IN
            UPDATE runcell_queue q
            SET parked = false, expired_at = v_now, failing_by = p_taker, failing_at = v_now
            WHERE q.limiter = v_limiter AND q.parked AND q.granted_lease_id IS NULL
              AND q.expired_at IS NULL AND q.deadline <= v_now
              AND (p_broker IS NULL OR q.broker IS NULL OR q.broker = p_broker)
            RETURNING q.*
        LOOP
            v_i := array_position(v_row.workloads, v_gone.workload);
            IF v_i IS NOT NULL THEN
                v_row.waiting[v_i] := greatest(0, v_row.waiting[v_i] - 1);
            END IF;
            RETURN NEXT v_gone;
        END LOOP;
        PERFORM runcell_store_counts(v_row);
    END LOOP;
    RETURN QUERY
        UPDATE runcell_queue q SET failing_by = p_taker, failing_at = clock_timestamp()
        WHERE q.expired_at IS NOT NULL AND q.failing_at < v_start
          AND (q.failing_by = p_taker
               OR q.failing_at < v_start - p_retake_after_ms * interval '1 millisecond')
          AND (p_broker IS NULL OR q.broker IS NULL OR q.broker = p_broker)
        RETURNING q.*;
END;
$$;

-- Phase two: delete expired requests whose failure was recorded. p_items is
-- [[limiter, request_id], ...]. Returns {"s": "completed", "n": rows deleted}.
CREATE OR REPLACE FUNCTION runcell_complete_expired(p_items jsonb, p_op_id uuid)
RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE
    v_done jsonb;
    v_n integer;
BEGIN
    v_done := runcell_op_begin(p_op_id);
    IF v_done IS NOT NULL THEN
        RETURN v_done;
    END IF;
    DELETE FROM runcell_queue q
    USING jsonb_array_elements(p_items) AS i(item)
    WHERE q.limiter = i.item->>0 AND q.request_id = i.item->>1 AND q.expired_at IS NOT NULL;
    GET DIAGNOSTICS v_n = ROW_COUNT;
    RETURN runcell_op_end(p_op_id, jsonb_build_object('s', 'completed', 'n', v_n));
END;
$$;

-- A database created by an earlier revision has limiter rows without the array form
-- of their limits and without kept counts: derive both once, from the rows.
DO $$
DECLARE
    v_name text;
BEGIN
    FOR v_name IN SELECT name FROM runcell_limiter WHERE workloads = '{}'
                  ORDER BY name COLLATE "C" LOOP
        PERFORM runcell_set_limits(v_name);
    END LOOP;
END;
$$;

