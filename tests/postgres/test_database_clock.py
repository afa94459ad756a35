"""The waiting room's estimate of the database's clock, which dates every grant locally.

Each round trip gives a lower bound of (local monotonic - database epoch): the server
read its clock after the statement was sent. The estimate must stay a lower bound (a
lease is never thought to live longer than the database lets it) and must not be spoilt
by one slow statement, whose database time was read long after it was sent.
"""

from __future__ import annotations

from runcell_celery.postgres.waiting import DatabaseClock

TRUE_OFFSET = 50.0  # local monotonic = database epoch + 50


def _round_trip(clock: DatabaseClock, sent: float, server_delay: float) -> None:
    """A statement sent at ``sent`` whose database clock was read ``server_delay`` later."""
    clock.sample(sent, sent + server_delay - TRUE_OFFSET)


def test_a_statement_that_waited_for_the_row_lock_does_not_age_every_grant() -> None:
    clock = DatabaseClock()
    _round_trip(clock, 100.0, 0.001)  # a quick one
    _round_trip(clock, 101.0, 1.2)  # waited 1.2 s for the limiter row's lock
    grant_at = 102.0 - TRUE_OFFSET  # a grant the database made at local time 102
    local = clock.local(grant_at)
    assert local is not None
    assert local <= 102.0, "the estimate must err early"
    assert local > 102.0 - 0.01, "one slow statement moved every grant 1.2 s earlier"


def test_only_the_last_minute_of_samples_counts() -> None:
    clock = DatabaseClock()
    _round_trip(clock, 100.0, 0.001)
    # Two minutes later the clocks have drifted 5 ms apart (an exaggerated drift): a
    # bound from then would now be too late; only recent samples may count.
    clock.sample(220.0, 220.0 + 0.002 - (TRUE_OFFSET - 0.005))
    local = clock.local(230.0 - (TRUE_OFFSET - 0.005))
    assert local is not None
    assert local <= 230.0


def test_no_sample_no_estimate() -> None:
    assert DatabaseClock().local(1.0) is None
