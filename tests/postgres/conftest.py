from tests.conftest import events
from tests.support.pg import fresh_dsn, make_limiter, pg_dsn

__all__ = ["events", "fresh_dsn", "make_limiter", "pg_dsn"]
