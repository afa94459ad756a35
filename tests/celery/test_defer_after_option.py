"""The ``defer_after_ms`` task option: the threshold of the expected-wait rule that
decides when a deferrable task parks, and ``admission_wait_ms`` as its fixed-wait
override. Parsing only: the rule itself runs against PostgreSQL in
``tests/postgres/test_deferral_rule.py``."""

from __future__ import annotations

from typing import Any

import pytest

from runcell_celery import ConcurrencyConfigError
from runcell_celery.celery.options import DEFAULT_DEFER_AFTER_MS, TaskConcurrency


def _parse(**options: Any) -> TaskConcurrency:
    return TaskConcurrency.parse(
        {"limiter": "claude", "admission": "defer", **options}, task_name="demo.summarize"
    )


def test_a_deferrable_task_decides_by_the_expected_wait_unless_told_a_fixed_wait() -> None:
    spec = _parse()
    assert spec.admission_wait_ms is None  # no fixed wait: the rule decides
    assert spec.defer_after_ms == DEFAULT_DEFER_AFTER_MS == 1_000


def test_an_explicit_admission_wait_is_kept_as_given() -> None:
    assert _parse(admission_wait_ms=50).admission_wait_ms == 50
    assert _parse(admission_wait_ms=0).admission_wait_ms == 0


def test_the_threshold_can_be_set_per_task() -> None:
    assert _parse(defer_after_ms=250).defer_after_ms == 250
    assert _parse(defer_after_ms=0).defer_after_ms == 0  # park whenever a wait is expected


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (-1, r"\['defer_after_ms'\] = -1 is invalid: must not be negative"),
        (1e300, r"\['defer_after_ms'\] = 1e\+300 is invalid: must be at most 2147483647 ms"),
        ("1s", r"\['defer_after_ms'\] = '1s' is invalid: must be a number"),
        (True, r"\['defer_after_ms'\] = True is invalid: must be a number"),
        (float("nan"), r"\['defer_after_ms'\] = nan is invalid: must be a number"),
    ],
)
def test_a_bad_threshold_is_refused_naming_the_task_the_field_and_the_bound(
    value: object, message: str
) -> None:
    with pytest.raises(ConcurrencyConfigError, match=message) as raised:
        _parse(defer_after_ms=value)
    assert "task 'demo.summarize' concurrency" in str(raised.value)


def test_a_threshold_beside_a_fixed_wait_is_refused_as_contradictory() -> None:
    with pytest.raises(
        ConcurrencyConfigError,
        match=r"\['defer_after_ms'\] is invalid beside 'admission_wait_ms'",
    ):
        _parse(admission_wait_ms=100, defer_after_ms=500)
