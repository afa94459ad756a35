"""A setting that may hold a password is never echoed: not in an error (nor any
exception chained to it), not in a log record.

Each secret-bearing input is fed bad in every form it is accepted in, through each
path that reads it: ``LimiterRegistry.configure`` (``app.conf.runcell`` and Django's
``RUNCELL`` share it), a Celery app's ``app.conf.runcell``, the PostgreSQL backend and
``create_postgres_concurrency_limiter`` (a DSN or a pool). Every test has a secret of
its own (:func:`tests.support.secrets.unique_secret`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery
from psycopg_pool import ConnectionPool

from runcell_celery import ConcurrencyConfigError, ConcurrencyError, slot
from runcell_celery.celery import registry_for
from runcell_celery.celery.state import discard_state
from runcell_celery.postgres import (
    PostgresBackend,
    create_postgres_concurrency_limiter,
)
from runcell_celery.redaction import MaskedDSN, mask_dsn, scrub, shape
from runcell_celery.registry import LimiterRegistry
from tests.support.secrets import everything_shown, unique_secret

LIMITERS = {"claude": {"max_concurrent": 1}}

#: DATABASE given as something that is not a DSN string, each holding the secret.
NOT_A_DSN: list[Callable[[str], Any]] = [
    lambda s: {"ENGINE": "django.db.backends.postgresql", "NAME": "app", "PASSWORD": s},
    lambda s: f"postgresql://app:{s}@db/app".encode(),
    lambda s: [f"postgresql://app:{s}@db/app"],
    lambda s: (f"password={s}",),
    lambda s: {"dsn": f"host=db password={s}"},
]

#: DSNs that do not parse, each with the secret as its password.
MALFORMED: list[Callable[[str], str]] = [
    lambda s: f"postgresql://app:{s}@[db/app",  # psycopg quotes the whole URI
    lambda s: f"postgresql://app:{s}%ZZ@db/app",  # ... or the bad percent-encoding
    lambda s: f"host=db password={s} junk",
    lambda s: f"host=db password='{s}",
    lambda s: f"postgresql://app:{s}@db/app?nonsense=1",
]

#: DSNs that parse but reach nothing, each with the secret as its password.
UNREACHABLE: list[Any] = [
    lambda s: f"postgresql://postgres:{s}@127.0.0.1:1/postgres",
    lambda s: f"host=127.0.0.1 port=1 user=postgres password={s} dbname=postgres",
    lambda s: f"host=127.0.0.1 port=1 password='{s} with spaces'",
    # libpq ends the password at its first "@": the rest is the host, echoed in
    # "failed to resolve host" (by psycopg_pool's own log records too: they are its).
    pytest.param(
        lambda s: f"postgresql://postgres:{s[:8]}@{s[8:]}@nohost.invalid/postgres",
        id="at-sign-in-password",
    ),
]


def assert_never_shown(
    secret: str,
    error: BaseException,
    caplog: pytest.LogCaptureFixture,
    loggers: str = "",
) -> None:
    """Neither the secret nor either half of it is in the error's chain or in a log
    record (of every logger, or of those under ``loggers``)."""
    logged = "\n".join(
        f"{r.getMessage()} {r.exc_text or ''}" for r in caplog.records if r.name.startswith(loggers)
    )
    for part in (secret, secret[:8], secret[8:]):
        assert part not in everything_shown(error)
        assert part not in logged


@pytest.mark.parametrize("form", NOT_A_DSN)
def test_a_database_setting_that_is_not_a_dsn_is_named_by_its_shape_only(
    form: Callable[[str], Any], caplog: pytest.LogCaptureFixture
) -> None:
    secret = unique_secret()
    value = form(secret)
    with pytest.raises(ConcurrencyConfigError) as raised:
        LimiterRegistry().configure({"DATABASE": value, "LIMITERS": LIMITERS})
    assert_never_shown(secret, raised.value, caplog)
    assert f'RUNCELL["DATABASE"] is invalid: {shape(value)}' in str(raised.value)


@pytest.mark.parametrize("form", NOT_A_DSN)
def test_a_celery_apps_database_setting_is_never_echoed(
    form: Callable[[str], Any], caplog: pytest.LogCaptureFixture
) -> None:
    secret = unique_secret()
    app = Celery("secrets", set_as_current=False)
    app.conf.runcell = {"DATABASE": form(secret), "LIMITERS": LIMITERS}
    try:
        with pytest.raises(ConcurrencyConfigError) as raised:
            registry_for(app)
    finally:
        discard_state(app)
    assert_never_shown(secret, raised.value, caplog)
    assert 'app.conf.runcell["DATABASE"] is invalid' in str(raised.value)


def test_the_settings_themselves_given_as_a_list_are_named_by_their_shape(
    caplog: pytest.LogCaptureFixture,
) -> None:
    secret = unique_secret()
    with pytest.raises(ConcurrencyConfigError) as raised:
        LimiterRegistry().configure([("DATABASE", f"postgresql://a:{secret}@db/a")])  # type: ignore[arg-type]
    assert_never_shown(secret, raised.value, caplog)
    assert "RUNCELL is invalid: a list of 1 item, must be a dict" in str(raised.value)


@pytest.mark.parametrize("form", MALFORMED)
def test_a_malformed_dsn_is_refused_with_its_password_masked_on_every_path(
    form: Callable[[str], str], caplog: pytest.LogCaptureFixture
) -> None:
    secret = unique_secret()
    dsn = form(secret)
    caplog.set_level(logging.DEBUG)
    registry = LimiterRegistry()
    registry.configure({"DATABASE": dsn, "LIMITERS": LIMITERS}, path="app.conf.runcell")
    with pytest.raises(ConcurrencyConfigError) as raised:
        registry.get("claude")  # the backend is built in the process that uses it
    assert_never_shown(secret, raised.value, caplog)
    assert str(raised.value).startswith('app.conf.runcell["DATABASE"] = ')
    assert "is invalid: not a PostgreSQL DSN" in str(raised.value)
    with pytest.raises(ConcurrencyConfigError) as raised:
        create_postgres_concurrency_limiter(dsn, max_concurrent=1)
    assert_never_shown(secret, raised.value, caplog)
    with pytest.raises(ConcurrencyConfigError) as raised:
        PostgresBackend(database=dsn)
    assert_never_shown(secret, raised.value, caplog)


@pytest.mark.parametrize("form", UNREACHABLE)
def test_an_unreachable_dsn_fails_closed_without_its_password(
    form: Callable[[str], str], caplog: pytest.LogCaptureFixture
) -> None:
    secret = unique_secret()
    caplog.set_level(logging.DEBUG)

    def use() -> None:
        limiter = create_postgres_concurrency_limiter(
            form(secret), max_concurrent=1, connect_timeout_ms=1_000
        )
        with slot(limiter, timeout_ms=1_000):
            pass

    with pytest.raises(ConcurrencyError) as raised:
        use()  # the limiter's backend is closed: its pool stops retrying
    assert "the database failed" in str(raised.value)
    at_sign = "@nohost.invalid" in form(secret)
    assert_never_shown(secret, raised.value, caplog, "runcell_celery" if at_sign else "")


def test_a_pool_whose_dsn_has_a_password_fails_closed_without_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    secret = unique_secret()
    caplog.set_level(logging.DEBUG)
    pool: ConnectionPool[Any] = ConnectionPool(
        f"postgresql://postgres:{secret}@127.0.0.1:1/postgres",
        open=False,
        timeout=1,
        kwargs={"autocommit": True},
    )
    try:
        with pytest.raises(ConcurrencyError) as raised:
            create_postgres_concurrency_limiter(pool, max_concurrent=1)
        assert_never_shown(secret, raised.value, caplog)
        assert secret not in repr(PostgresBackend(database=pool))
    finally:
        pool.close()


def test_masking_covers_both_dsn_forms_and_the_reprs_that_carry_them() -> None:
    secret = unique_secret()
    assert mask_dsn(f"postgresql://app:{secret}@db:5432/app") == "postgresql://app:***@db:5432/app"
    assert (
        mask_dsn(f"host=db password='{secret} x' dbname=app") == "host=db password=*** dbname=app"
    )
    assert mask_dsn(f"postgresql://db/app?password={secret}&sslmode=require") == (
        "postgresql://db/app?password=***&sslmode=require"
    )
    assert secret not in scrub(repr({"PASSWORD": secret, "NAME": "app"}))
    dsn = MaskedDSN(f"postgresql://app:{secret}@db/app")
    assert secret not in repr(dsn)
    assert secret not in repr({"DATABASE": dsn})
    assert str(dsn) == f"postgresql://app:{secret}@db/app"  # still the DSN itself
