"""The conformance suites against the PostgreSQL limiter, woken by NOTIFY and polling:
the core cases, keys, and several limiters in one request. A case's limiters come from
one backend (as a registry's do), closed after the case."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from runcell_celery.config import limiter_config
from runcell_celery.conformance import (
    concurrency_conformance_cases,
    keyed_conformance_cases,
    members_conformance_cases,
)
from runcell_celery.postgres import PostgresBackend, PostgresConcurrencyLimiter
from tests.support.pg import unique_name

CASE_NAMES = [case.name for case in concurrency_conformance_cases(lambda **options: None)]
KEYED_CASE_NAMES = [case.name for case in keyed_conformance_cases(lambda **options: None)]
MEMBER_CASE_NAMES = [case.name for case in members_conformance_cases(lambda **options: None)]


Factory = Callable[..., PostgresConcurrencyLimiter]


@pytest.fixture
def factory(pg_dsn: str, listen: bool) -> Iterator[Factory]:
    backend = PostgresBackend(database=pg_dsn, options={"listen": listen})

    def create(max_concurrent: int, **options: Any) -> PostgresConcurrencyLimiter:
        config = limiter_config(max_concurrent, name=unique_name("conformance"), **options)
        return backend.create_limiter(config)

    yield create
    backend.close()


@pytest.mark.parametrize("name", CASE_NAMES)
@pytest.mark.parametrize("listen", [True, False], ids=["notify", "poll"])
def test_postgres_limiter_conforms(factory: Factory, name: str) -> None:
    cases = {case.name: case for case in concurrency_conformance_cases(factory)}
    cases[name].run()


@pytest.mark.parametrize("name", KEYED_CASE_NAMES)
@pytest.mark.parametrize("listen", [True, False], ids=["notify", "poll"])
def test_postgres_keyed_limiter_conforms(factory: Factory, name: str) -> None:
    cases = {case.name: case for case in keyed_conformance_cases(factory)}
    cases[name].run()


@pytest.mark.parametrize("name", MEMBER_CASE_NAMES)
@pytest.mark.parametrize("listen", [True, False], ids=["notify", "poll"])
def test_postgres_limiters_held_together_conform(factory: Factory, name: str) -> None:
    cases = {case.name: case for case in members_conformance_cases(factory)}
    cases[name].run()
