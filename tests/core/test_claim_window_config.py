"""The claim window setting: how long a grant to a parked task waits for its claim."""

from __future__ import annotations

import pytest

from runcell_celery import ConcurrencyConfigError, LimiterConfig
from runcell_celery.config import DEFAULT_CLAIM_WINDOW_MS


def test_the_claim_window_defaults_to_a_few_seconds_and_never_past_the_lease_ttl() -> None:
    assert LimiterConfig(max_concurrent=2).claim_window_ms == DEFAULT_CLAIM_WINDOW_MS == 5_000
    assert LimiterConfig(max_concurrent=2, lease_ttl_ms=800).claim_window_ms == 800


def test_limits_stored_before_the_claim_window_existed_keep_their_form_at_the_default() -> None:
    assert "claim_window_ms" not in LimiterConfig(max_concurrent=2).to_dict()
    assert LimiterConfig(max_concurrent=2, claim_window_ms=1_500).to_dict()["claim_window_ms"] == (
        1_500
    )
    given = LimiterConfig(max_concurrent=2, claim_window_ms=1_500)
    assert given.differences(LimiterConfig(max_concurrent=2)) == ["claim_window_ms"]


@pytest.mark.parametrize(
    ("value", "rule"),
    [
        (99, "must be at least 100"),
        (30_001, "must not exceed lease_ttl_ms (30000)"),
        ("3s", "must be an integer"),
        (True, "must be an integer"),
    ],
)
def test_a_claim_window_out_of_bounds_is_refused_naming_the_field_and_the_bound(
    value: object, rule: str
) -> None:
    with pytest.raises(ConcurrencyConfigError) as caught:
        LimiterConfig.from_mapping(
            {"max_concurrent": 2, "claim_window_ms": value}, path='RUNCELL["LIMITERS"]["claude"]'
        )
    message = str(caught.value)
    assert message.startswith(f'RUNCELL["LIMITERS"]["claude"]["claim_window_ms"] = {value!r}')
    assert rule in message
