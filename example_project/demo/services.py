"""Find PostgreSQL and Redis: the environment first, then localhost, then embedded.

* PostgreSQL: ``RUNCELL_DEMO_DATABASE_URL`` (the database the demo may own; created
  if missing), then ``postgresql://postgres@127.0.0.1:5432/runcell_demo``, then the
  embedded server (:mod:`.embedded`) with a ``runcell_demo`` database.
* Redis: ``RUNCELL_DEMO_REDIS_URL``, then ``redis://127.0.0.1:6379/0``, then embedded.

A candidate that does not answer is reported and skipped, so an environment that
points nowhere still ends with a running demo.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

import psycopg
import redis
from psycopg import sql

from .embedded import start_postgres, start_redis
from .paths import Paths
from .processes import Processes

__all__ = ["DATABASE_ENV", "REDIS_ENV", "Services", "find_services"]

DATABASE_ENV = "RUNCELL_DEMO_DATABASE_URL"
REDIS_ENV = "RUNCELL_DEMO_REDIS_URL"
LOCAL_DATABASE = "postgresql://postgres@127.0.0.1:5432/runcell_demo"
LOCAL_REDIS = "redis://127.0.0.1:6379/0"
DEMO_DATABASE = "runcell_demo"

Say = Callable[[str], None]


@dataclass(frozen=True)
class Services:
    database_url: str
    database_source: str
    redis_url: str
    redis_source: str


def with_dbname(url: str, dbname: str) -> str:
    """The same server's database ``dbname`` (a URL stays a URL)."""
    if "://" in url:
        return urlunsplit(urlsplit(url)._replace(path=f"/{dbname}"))
    params = psycopg.conninfo.conninfo_to_dict(url)
    params["dbname"] = dbname
    return psycopg.conninfo.make_conninfo("", **params)


def redact(url: str) -> str:
    """The URL without its password, for the terminal."""
    params = psycopg.conninfo.conninfo_to_dict(url) if "://" not in url else None
    if params is not None:
        params.pop("password", None)
        return psycopg.conninfo.make_conninfo("", **params)
    scheme, _, rest = url.partition("://")
    credentials, at, host = rest.rpartition("@")
    if not at or ":" not in credentials:
        return url
    return f"{scheme}://{credentials.split(':', 1)[0]}:***@{host}"


def ensure_database(url: str, *, attempts: int = 1) -> str:
    """Connect to ``url``'s database, creating it first if missing; return ``url``.

    :raises psycopg.OperationalError: the server does not answer (or refuses us).
    """
    params = psycopg.conninfo.conninfo_to_dict(url)
    for attempt in range(1, attempts + 1):
        try:
            with psycopg.connect(url, connect_timeout=3):
                return url
        except psycopg.OperationalError as exc:
            if "does not exist" in str(exc):
                break
            if attempt == attempts:
                raise
            time.sleep(0.3)  # a server that is still starting up
    with psycopg.connect(with_dbname(url, "postgres"), connect_timeout=3, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(str(params["dbname"]))))
    return url


def _ping_redis(url: str) -> str:
    client = redis.Redis.from_url(url, socket_connect_timeout=3, socket_timeout=3)
    try:
        client.ping()
    finally:
        client.close()
    return url


def find_services(
    paths: Paths,
    processes: Processes,
    environ: dict[str, str],
    *,
    localhost: bool = True,
    embedded_only: bool = False,
    say: Say = print,
) -> Services:
    """Find or start both services; report each choice with ``say``."""
    database_url, database_source = _find(
        "PostgreSQL",
        [] if embedded_only else _candidates(environ, DATABASE_ENV, LOCAL_DATABASE, localhost),
        ensure_database,
        lambda: ensure_database(
            with_dbname(start_postgres(paths, processes), DEMO_DATABASE), attempts=30
        ),
        say,
        str(paths.home),
    )
    redis_url, redis_source = _find(
        "Redis",
        [] if embedded_only else _candidates(environ, REDIS_ENV, LOCAL_REDIS, localhost),
        _ping_redis,
        lambda: _ping_redis(start_redis(paths, processes)),
        say,
        str(paths.home),
    )
    return Services(database_url, database_source, redis_url, redis_source)


def _candidates(
    environ: dict[str, str], variable: str, local: str, localhost: bool
) -> list[tuple[str, str]]:
    found = []
    if environ.get(variable):
        found.append((environ[variable], variable))
    if localhost:
        found.append((local, "localhost"))
    return found


def _find(
    what: str,
    candidates: list[tuple[str, str]],
    check: Callable[[str], str],
    embedded: Callable[[], str],
    say: Say,
    home: str,
) -> tuple[str, str]:
    for url, source in candidates:
        try:
            check(url)
        except Exception as exc:
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            say(f"{what}: {redact(url)} ({source}) does not answer: {reason}")
            continue
        say(f"{what}: {redact(url)} ({source})")
        return url, source
    say(f"{what}: starting the embedded server in {home}")
    url = embedded()
    say(f"{what}: {redact(url)} (embedded)")
    return url, "embedded"
