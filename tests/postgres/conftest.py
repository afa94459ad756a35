from tests.support.pg import fresh_dsn, make_limiter, pg_dsn

__all__ = ["fresh_dsn", "make_limiter", "pg_dsn"]
