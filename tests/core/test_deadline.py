"""Deadlines: one monotonic instant per budget, converted to wall-clock time only at edges."""

from __future__ import annotations

import math
import time

import pytest

from runcell_celery import Deadline


@pytest.mark.parametrize("ms", [math.inf, -math.inf, math.nan])
def test_a_deadline_needs_a_finite_duration(ms: float) -> None:
    with pytest.raises(ValueError, match="finite duration"):
        Deadline.after_ms(ms)


def test_a_deadline_counts_down_from_the_instant_it_was_set() -> None:
    deadline = Deadline.after_ms(250, now=100.0)
    assert deadline.at == 100.25
    assert deadline.remaining_ms(now=100.0) == pytest.approx(250)
    assert deadline.remaining_ms(now=100.5) == pytest.approx(-250)
    assert deadline.remaining_s(now=100.5) == 0.0
    assert not deadline.passed(now=100.2)
    assert deadline.passed(now=100.25)


def test_the_earliest_deadline_wins_and_none_means_no_deadline() -> None:
    soon, later = Deadline(10.0), Deadline(20.0)
    assert Deadline.earliest(later, None, soon) == soon
    assert Deadline.earliest(None, None) is None
    assert Deadline.earliest() is None
    assert soon < later


def test_a_unix_timestamp_becomes_the_same_moment_on_the_monotonic_clock() -> None:
    deadline = Deadline.from_unix(time.time() + 30)
    assert 29_000 < deadline.remaining_ms() <= 30_000
    assert abs(deadline.to_unix() - (time.time() + deadline.remaining_ms() / 1000)) < 0.5
