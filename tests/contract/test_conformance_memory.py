"""The conformance suites, run against the in-memory limiter: the core cases, keys,
and several limiters in one request."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from runcell_celery import ConcurrencyLimiter, create_concurrency_limiter
from runcell_celery.conformance import (
    ConformanceCase,
    concurrency_conformance_cases,
    keyed_conformance_cases,
    members_conformance_cases,
)

_numbers = itertools.count(1)


def create(**options: Any) -> ConcurrencyLimiter:
    # A name of its own: limiters held together in one slot must differ by name.
    limiter: ConcurrencyLimiter = create_concurrency_limiter(
        name=f"conformance-{next(_numbers)}", **options
    )
    return limiter


CASES = concurrency_conformance_cases(create)
KEYED_CASES = keyed_conformance_cases(create)
MEMBER_CASES = members_conformance_cases(create)


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_in_memory_limiter_conforms(case: ConformanceCase) -> None:
    case.run()


@pytest.mark.parametrize("case", KEYED_CASES, ids=lambda case: case.name)
def test_in_memory_keyed_limiter_conforms(case: ConformanceCase) -> None:
    case.run()


@pytest.mark.parametrize("case", MEMBER_CASES, ids=lambda case: case.name)
def test_in_memory_limiters_held_together_conform(case: ConformanceCase) -> None:
    case.run()
