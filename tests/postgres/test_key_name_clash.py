"""A PostgreSQL limiter named like a key of a keyed one is refused when it is stored,
whichever of the two comes first, naming both (issue 20, item 7)."""

from __future__ import annotations

import pytest

from runcell_celery import ConcurrencyConfigError, slot
from runcell_celery.postgres import create_postgres_concurrency_limiter
from tests.support.pg import unique_name


def test_a_keyed_limiter_after_a_plain_one_named_like_its_key_is_refused(pg_dsn: str) -> None:
    tenant = unique_name("tenant")
    plain = create_postgres_concurrency_limiter(pg_dsn, max_concurrent=1, name=f"{tenant}:acme")
    with pytest.raises(ConcurrencyConfigError) as caught:
        create_postgres_concurrency_limiter(pg_dsn, max_concurrent=2, name=tenant, keyed=True)
    message = caught.value.message
    assert f"limiter '{tenant}:acme'" in message
    assert f"keyed limiter '{tenant}'" in message
    assert "is stored already" in message
    with slot(plain):  # the limiter stored first is untouched
        pass


def test_a_plain_limiter_after_a_keyed_one_named_like_its_key_is_refused(pg_dsn: str) -> None:
    tenant = unique_name("tenant")
    keyed = create_postgres_concurrency_limiter(pg_dsn, max_concurrent=2, name=tenant, keyed=True)
    with pytest.raises(ConcurrencyConfigError) as caught:
        create_postgres_concurrency_limiter(pg_dsn, max_concurrent=1, name=f"{tenant}:acme")
    message = caught.value.message
    assert f"limiter '{tenant}:acme'" in message
    assert f"keyed limiter '{tenant}'" in message
    with slot(keyed.key("acme")):  # the key still works
        pass


def test_a_keyed_limiter_beside_a_plain_one_of_a_longer_name_is_accepted(pg_dsn: str) -> None:
    tenant = unique_name("tenant")
    create_postgres_concurrency_limiter(pg_dsn, max_concurrent=1, name=f"{tenant}x:acme")
    keyed = create_postgres_concurrency_limiter(pg_dsn, max_concurrent=2, name=tenant, keyed=True)
    with slot(keyed.key("acme")):
        pass


def test_a_limiter_name_with_nul_is_refused_before_connecting() -> None:
    with pytest.raises(ConcurrencyConfigError, match="must not contain control characters"):
        create_postgres_concurrency_limiter(
            "postgresql://postgres@127.0.0.1:1/nowhere", max_concurrent=1, name="a\x00b"
        )
