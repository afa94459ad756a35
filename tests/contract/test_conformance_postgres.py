"""The conformance suite against the PostgreSQL limiter: woken by NOTIFY, and polling."""

from __future__ import annotations

import pytest

from runcell_celery.conformance import concurrency_conformance_cases
from runcell_celery.postgres import create_postgres_concurrency_limiter
from tests.support.pg import unique_name

CASE_NAMES = [case.name for case in concurrency_conformance_cases(lambda **options: None)]


@pytest.mark.parametrize("name", CASE_NAMES)
@pytest.mark.parametrize("listen", [True, False], ids=["notify", "poll"])
def test_postgres_limiter_conforms(pg_dsn: str, listen: bool, name: str) -> None:
    def create(**options: object) -> object:
        return create_postgres_concurrency_limiter(
            pg_dsn, name=unique_name("conformance"), listen=listen, **options
        )

    cases = {case.name: case for case in concurrency_conformance_cases(create)}
    cases[name].run()
