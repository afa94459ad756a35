from tests.support.pg import pg_dsn

__all__ = ["pg_dsn"]
