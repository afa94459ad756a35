"""A rolling change of limits: workers with old settings work on the stored limits.

``on_conflict="use_stored"``: a worker whose settings differ from the stored limits
(at startup, or because another worker replaced them while it runs) takes the stored
limits and their hash instead of failing each acquire, and says so once per limiter.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import ExitStack

import pytest

from runcell_celery import ConcurrencyConfigError, ConcurrencyTimeoutError, slot
from runcell_celery.postgres import create_postgres_concurrency_limiter
from tests.conftest import EventRecorder
from tests.support.pg import unique_name

ADOPTED = "uses the stored limits"


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if ADOPTED in r.getMessage()]


@pytest.fixture
def warnings_caught(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    with caplog.at_level(logging.WARNING, logger="runcell_celery.postgres"):
        yield caplog


def test_an_old_worker_keeps_acquiring_under_the_new_stored_limits_after_a_replace(
    pg_dsn: str, events: EventRecorder, warnings_caught: pytest.LogCaptureFixture
) -> None:
    name = unique_name("rolling")
    old = create_postgres_concurrency_limiter(
        pg_dsn, name=name, max_concurrent=1, on_conflict="use_stored"
    )
    with slot(old):
        pass
    create_postgres_concurrency_limiter(
        pg_dsn,
        name=name,
        max_concurrent=3,
        workloads={"default": {"max_wait_ms": 50}},
        on_conflict="replace",
    )

    with ExitStack() as held:
        for _ in range(3):  # three at once: the new limit, not the old one's 1
            held.enter_context(slot(old))
        assert old.stats().active == 3
        with pytest.raises(ConcurrencyTimeoutError), slot(old):
            pass  # a fourth waits the new limits' max_wait_ms: the new limit holds
    assert old.config.max_concurrent == 3
    assert old.given_config.max_concurrent == 1

    adopted = [e for e in events.of("config-error", limiter=name) if e.error]
    assert len(adopted) == 1
    assert "max_concurrent (stored 3, given 1)" in str(adopted[0].error)
    assert adopted[0].request_id is not None  # the request that found the change
    assert len(_warnings(warnings_caught)) == 1


def test_a_worker_started_with_other_settings_works_on_the_stored_limits(
    pg_dsn: str, events: EventRecorder, warnings_caught: pytest.LogCaptureFixture
) -> None:
    name = unique_name("late")
    first = create_postgres_concurrency_limiter(pg_dsn, name=name, max_concurrent=2)
    late = create_postgres_concurrency_limiter(
        pg_dsn,
        name=name,
        max_concurrent=5,
        workloads={"default": {"max_wait_ms": 1_000}},
        on_conflict="use_stored",
    )
    assert late.config == first.config
    assert late.stored_hash == first.stored_hash
    with slot(late), slot(first):
        assert first.stats().active == 2
    [warning] = _warnings(warnings_caught)
    assert "max_concurrent (stored 2, given 5)" in warning
    assert "workloads.default.max_wait_ms" in warning
    assert len(events.of("config-error", limiter=name)) == 1


def test_each_change_of_the_stored_limits_is_said_once(
    pg_dsn: str, events: EventRecorder, warnings_caught: pytest.LogCaptureFixture
) -> None:
    name = unique_name("twice")
    old = create_postgres_concurrency_limiter(
        pg_dsn, name=name, max_concurrent=1, on_conflict="use_stored"
    )
    for limit in (2, 3):
        create_postgres_concurrency_limiter(
            pg_dsn, name=name, max_concurrent=limit, on_conflict="replace"
        )
        for _ in range(5):
            with slot(old):
                pass
        assert old.config.max_concurrent == limit
    assert len(_warnings(warnings_caught)) == 2
    assert len(events.of("config-error", limiter=name)) == 2


def test_without_use_stored_an_old_worker_still_fails_after_a_replace(
    pg_dsn: str, events: EventRecorder, warnings_caught: pytest.LogCaptureFixture
) -> None:
    name = unique_name("strict")
    old = create_postgres_concurrency_limiter(pg_dsn, name=name, max_concurrent=1)
    create_postgres_concurrency_limiter(pg_dsn, name=name, max_concurrent=3, on_conflict="replace")
    with pytest.raises(ConcurrencyConfigError, match="replaced by another worker"), slot(old):
        pass
    assert old.config.max_concurrent == 1
    assert _warnings(warnings_caught) == []


def test_a_key_of_an_old_keyed_limiter_takes_the_new_stored_limits(
    pg_dsn: str, events: EventRecorder, warnings_caught: pytest.LogCaptureFixture
) -> None:
    name = unique_name("tenant")
    old = create_postgres_concurrency_limiter(
        pg_dsn, name=name, max_concurrent=1, keyed=True, on_conflict="use_stored"
    )
    with slot(old.key("acme")):
        pass
    create_postgres_concurrency_limiter(
        pg_dsn, name=name, max_concurrent=2, keyed=True, on_conflict="replace"
    )
    acme, globex = old.key("acme"), old.key("globex")
    with slot(acme), slot(acme), slot(globex):
        assert acme.config.max_concurrent == 2
    assert len(_warnings(warnings_caught)) == 1  # one for the keyed limiter, not per key


def test_a_request_over_several_limiters_takes_the_replaced_limits_of_each(
    pg_dsn: str, events: EventRecorder, warnings_caught: pytest.LogCaptureFixture
) -> None:
    provider, model = unique_name("provider"), unique_name("model")
    old_provider = create_postgres_concurrency_limiter(
        pg_dsn, name=provider, max_concurrent=1, on_conflict="use_stored"
    )
    old_model = create_postgres_concurrency_limiter(
        pg_dsn, name=model, max_concurrent=1, on_conflict="use_stored"
    )
    create_postgres_concurrency_limiter(
        pg_dsn, name=provider, max_concurrent=2, on_conflict="replace"
    )
    create_postgres_concurrency_limiter(pg_dsn, name=model, max_concurrent=2, on_conflict="replace")
    with slot(old_provider, old_model), slot(old_provider, old_model):
        assert old_provider.stats().active == 2
    assert len(_warnings(warnings_caught)) == 2
