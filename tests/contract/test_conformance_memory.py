"""The conformance suite, run against the in-memory limiter."""

from __future__ import annotations

import pytest

from runcell_celery import create_concurrency_limiter
from runcell_celery.conformance import ConformanceCase, concurrency_conformance_cases

CASES = concurrency_conformance_cases(lambda **options: create_concurrency_limiter(**options))


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_in_memory_limiter_conforms(case: ConformanceCase) -> None:
    case.run()
