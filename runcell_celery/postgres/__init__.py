"""The PostgreSQL backend: concurrency limits shared by every worker on every host.

.. code-block:: python

    from runcell_celery.postgres import create_postgres_concurrency_limiter

    claude = create_postgres_concurrency_limiter(
        "postgresql://app@db/app", name="claude", max_concurrent=8,
        workloads={"interactive": {"reserved": 2, "priority": 10},
                   "background": {"max_concurrent": 6}},
    )

The integration layers use :class:`PostgresBackend` (one per registry and process):
it creates limiters and offers the stores of :mod:`runcell_celery.ports`. Everything
they need is exported here, with :mod:`.operations` (the operators' commands: status,
storing limits, force release, purging events); the other modules are internal.

Needs the ``postgres`` extra (psycopg 3 and psycopg_pool).
"""

from .backend import LimiterState, PostgresBackend, ReleasedLease
from .connection import check_dsn
from .factory import create_postgres_concurrency_limiter
from .gauges import WorkloadGauges, read_workload_gauges
from .limiter import PostgresConcurrencyLimiter
from .options import OnConflict, PostgresOptions
from .parking import REPUBLISH_AFTER_MS
from .schema import SCHEMA_VERSION, ensure_schema, postgres_concurrency_schema_sql

__all__ = [
    "REPUBLISH_AFTER_MS",
    "SCHEMA_VERSION",
    "LimiterState",
    "OnConflict",
    "PostgresBackend",
    "PostgresConcurrencyLimiter",
    "PostgresOptions",
    "ReleasedLease",
    "WorkloadGauges",
    "check_dsn",
    "create_postgres_concurrency_limiter",
    "ensure_schema",
    "postgres_concurrency_schema_sql",
    "read_workload_gauges",
]
