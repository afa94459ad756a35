"""Every SQL statement the PostgreSQL limiter sends, named after what it does.

The allocation logic under the limiter row's lock lives in ``schema.sql`` as
PL/pgSQL functions (one round trip each); these statements call them. Parameters are
always bound (``%(name)s``), never formatted into the text.
"""

from __future__ import annotations

from typing import LiteralString

SCHEMA_IS_CURRENT: LiteralString = """
SELECT to_regclass('runcell_schema') IS NOT NULL
   AND to_regprocedure('runcell_lock_v1(text,uuid,text,text,integer)') IS NOT NULL
"""

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
# as one simple-query message (client-side binding, see limiter._Transaction).

#: Round trip 1: start the transaction and take the limiter row's lock.
BEGIN_AND_LOCK: LiteralString = """
BEGIN;
SELECT runcell_lock_v1(%(limiter)s, %(release_lease)s::uuid, %(withdraw_request)s,
                       %(request_id)s, %(max_per_workload)s)
"""

#: A release or withdrawal that finds nobody to grant is done in this one round trip.
LOCK_AND_COMMIT: LiteralString = """
BEGIN;
SELECT runcell_lock_v1(%(limiter)s, %(release_lease)s::uuid, %(withdraw_request)s,
                       %(request_id)s, %(max_per_workload)s);
COMMIT
"""

#: Round trip 2: write the decision and commit.
APPLY_AND_COMMIT: LiteralString = """
SELECT runcell_apply_v1(%(limiter)s, %(grants)s, %(caller)s, %(caller_action)s,
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

STATS: LiteralString = """
SELECT 'active' AS kind, workload, count(*) FROM runcell_lease
WHERE limiter = %(limiter)s AND expires_at > clock_timestamp()
GROUP BY workload
UNION ALL
SELECT 'queued', workload, count(*) FROM runcell_queue
WHERE limiter = %(limiter)s AND expires_at > clock_timestamp()
GROUP BY workload
"""

NOTIFY_SELF_CHECK: LiteralString = "SELECT pg_notify('runcell_grant', %(payload)s)"

LISTEN: LiteralString = "LISTEN runcell_grant"
