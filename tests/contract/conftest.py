from tests.support.pg import fresh_dsn, pg_dsn
from tests.support.pgbouncer import pgbouncer_dsn, pgbouncer_server

__all__ = ["fresh_dsn", "pg_dsn", "pgbouncer_dsn", "pgbouncer_server"]
