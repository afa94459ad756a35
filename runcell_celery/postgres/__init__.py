"""The PostgreSQL limiter: one concurrency limit shared by every worker on every host.

.. code-block:: python

    from runcell_celery.postgres import create_postgres_concurrency_limiter

    claude = create_postgres_concurrency_limiter(
        "postgresql://app@db/app", name="claude", max_concurrent=8,
        workloads={"interactive": {"reserved": 2, "priority": 10},
                   "background": {"max_concurrent": 6}},
    )

Needs the ``postgres`` extra (psycopg 3 and psycopg_pool).
"""

from .factory import create_postgres_concurrency_limiter
from .limiter import PostgresConcurrencyLimiter
from .schema import postgres_concurrency_schema_sql

__all__ = [
    "PostgresConcurrencyLimiter",
    "create_postgres_concurrency_limiter",
    "postgres_concurrency_schema_sql",
]
