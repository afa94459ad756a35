"""The conformance suites against the PostgreSQL limiter, woken by NOTIFY and polling:
the core cases, keys, and several limiters in one request."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from runcell_celery.conformance import (
    concurrency_conformance_cases,
    keyed_conformance_cases,
    several_limiters_conformance_cases,
)
from runcell_celery.postgres import PostgresConcurrencyLimiter, create_postgres_concurrency_limiter
from tests.support.pg import unique_name

CASE_NAMES = [case.name for case in concurrency_conformance_cases(lambda **options: None)]
KEYED_CASE_NAMES = [case.name for case in keyed_conformance_cases(lambda **options: None)]
SEVERAL_CASE_NAMES = [
    case.name for case in several_limiters_conformance_cases(lambda **options: None)
]


def _factory(dsn: str, *, listen: bool) -> Callable[..., PostgresConcurrencyLimiter]:
    def create(**options: Any) -> PostgresConcurrencyLimiter:
        return create_postgres_concurrency_limiter(
            dsn, name=unique_name("conformance"), listen=listen, **options
        )

    return create


@pytest.mark.parametrize("name", CASE_NAMES)
@pytest.mark.parametrize("listen", [True, False], ids=["notify", "poll"])
def test_postgres_limiter_conforms(pg_dsn: str, listen: bool, name: str) -> None:
    cases = {
        case.name: case for case in concurrency_conformance_cases(_factory(pg_dsn, listen=listen))
    }
    cases[name].run()


@pytest.mark.parametrize("name", KEYED_CASE_NAMES)
@pytest.mark.parametrize("listen", [True, False], ids=["notify", "poll"])
def test_postgres_keyed_limiter_conforms(pg_dsn: str, listen: bool, name: str) -> None:
    cases = {case.name: case for case in keyed_conformance_cases(_factory(pg_dsn, listen=listen))}
    cases[name].run()


@pytest.mark.parametrize("name", SEVERAL_CASE_NAMES)
@pytest.mark.parametrize("listen", [True, False], ids=["notify", "poll"])
def test_postgres_limiters_held_together_conform(pg_dsn: str, listen: bool, name: str) -> None:
    factory = _factory(pg_dsn, listen=listen)
    cases = {case.name: case for case in several_limiters_conformance_cases(factory)}
    cases[name].run()
