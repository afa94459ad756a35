"""Events: every type is emitted with the spec's fields, and none leaks a secret."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import fields
from typing import TYPE_CHECKING, Any

import pytest

from runcell_celery import (
    EVENT_TYPES,
    CancellationToken,
    ConcurrencyConfigError,
    ConcurrencyError,
    ConcurrencyEvent,
    add_event_listener,
    create_concurrency_limiter,
    guard,
    remove_event_listener,
    run,
    slot,
)
from runcell_celery.background import DEFAULT_REGISTRY
from runcell_celery.events import describe_error, has_listeners

if TYPE_CHECKING:
    from tests.conftest import EventRecorder
    from tests.core.conftest import CustomLimiter

    CustomFactory = Callable[..., CustomLimiter]
    Full = Callable[..., Any]

SOON_S = 10.0

#: The optional fields; each event type must set exactly its own (the spec's table).
OPTIONAL = ("deadline", "lease_id", "fencing_token", "wait_ms", "hold_ms", "outcome", "reason")
EXTRA_FIELDS: dict[str, set[str]] = {
    "wait-started": {"deadline"},
    "acquired": {"lease_id", "wait_ms", "fencing_token"},
    "timed-out": {"wait_ms"},
    "queue-full": {"wait_ms"},
    "wait-cancelled": {"wait_ms"},
    "limiter-error": {"wait_ms", "error"},
    "config-error": {"error"},
    "released": {"lease_id", "hold_ms", "outcome"},
    "renewal-failed": {"lease_id", "error"},
    "lease-lost": {"lease_id", "hold_ms", "reason"},
    "release-failed": {"lease_id", "error"},
}


class Kit:
    """What a scenario needs: a fresh custom limiter and a way to fill it."""

    def __init__(self, custom_limiter: CustomFactory, limiter_full: Full) -> None:
        self.limiter = custom_limiter(1)
        self.full = limiter_full


def wait_started(kit: Kit) -> None:
    name = kit.limiter.name
    kit.limiter.inner = create_concurrency_limiter(
        1, name=name, workloads={"default": {"max_wait_ms": 20}}
    )
    with kit.full(kit.limiter.inner), slot():
        pass


def acquired_and_released(kit: Kit) -> None:
    with slot():
        pass


def timed_out(kit: Kit) -> None:
    wait_started(kit)


def queue_full(kit: Kit) -> None:
    kit.limiter.inner = create_concurrency_limiter(1, name=kit.limiter.name, max_queued=0)
    with kit.full(kit.limiter.inner), slot():
        pass


def wait_cancelled(kit: Kit) -> None:
    cancel = CancellationToken()
    threading.Timer(0.02, cancel.cancel).start()
    with kit.full(kit.limiter.inner), slot(cancel=cancel):
        pass


def limiter_error(kit: Kit) -> None:
    kit.limiter.acquire_error = OSError("connection refused")
    with slot():
        pass


def config_error(kit: Kit) -> None:
    with slot(workload="nope"):
        pass


def renewal_failed_and_lease_lost(kit: Kit) -> None:
    kit.limiter.inner = create_concurrency_limiter(1, name=kit.limiter.name, lease_ttl_ms=60)
    kit.limiter.renew_mode = "fail"
    with slot() as held:
        aborted = threading.Event()
        held.on_abort(aborted.set)
        aborted.wait(SOON_S)


def release_failed(kit: Kit) -> None:
    kit.limiter.release_error = OSError("connection reset")
    with slot():
        pass


SCENARIOS: dict[str, Callable[[Kit], None]] = {
    "wait-started": wait_started,
    "acquired": acquired_and_released,
    "timed-out": timed_out,
    "queue-full": queue_full,
    "wait-cancelled": wait_cancelled,
    "limiter-error": limiter_error,
    "config-error": config_error,
    "released": acquired_and_released,
    "renewal-failed": renewal_failed_and_lease_lost,
    "lease-lost": renewal_failed_and_lease_lost,
    "release-failed": release_failed,
}


def test_every_event_type_has_a_scenario() -> None:
    assert set(SCENARIOS) == set(EVENT_TYPES) == set(EXTRA_FIELDS)
    assert len(EVENT_TYPES) == 11


@pytest.mark.parametrize("event_type", EVENT_TYPES)
def test_each_event_type_is_emitted_with_its_extra_fields(
    event_type: str,
    custom_limiter: CustomFactory,
    limiter_full: Full,
    events: EventRecorder,
) -> None:
    kit = Kit(custom_limiter, limiter_full)
    with (
        run(limiter=kit.limiter, run_id="parent", name="summarize"),
        run(run_id="child"),
        contextlib.suppress(ConcurrencyError),
    ):
        SCENARIOS[event_type](kit)
    event = events.wait_for(event_type, limiter=kit.limiter.name)
    assert event.limiter == kit.limiter.name
    assert event.workload in ("default", "nope")
    assert (event.run_id, event.parent_run_id, event.root_run_id) == ("child", "parent", "parent")
    assert event.request_id is not None
    assert event.holder_name == "summarize"
    assert event.timestamp > 0
    present = {name for name in (*OPTIONAL, "error") if getattr(event, name) is not None}
    assert present == EXTRA_FIELDS[event_type]
    for name in ("wait_ms", "hold_ms"):
        value = getattr(event, name)
        assert value is None or value >= 0


def test_one_slot_emits_its_events_in_lifecycle_order(
    events: EventRecorder, limiter_full: Full
) -> None:
    limiter = create_concurrency_limiter(1, name="lifecycle")
    with limiter_full(limiter) as leases:
        threading.Timer(0.02, limiter.release, args=(leases[0],)).start()
        with slot(limiter):
            pass
    assert events.types(limiter="lifecycle") == ["wait-started", "acquired", "released"]
    started, acquired, released = events.events
    assert started.request_id == acquired.request_id == released.request_id
    assert acquired.lease_id == released.lease_id
    assert acquired.wait_ms is not None
    assert acquired.wait_ms > 0


# -- listeners ---------------------------------------------------------------------------------


def test_a_listener_that_raises_never_breaks_a_run(events: EventRecorder) -> None:
    def broken(event: ConcurrencyEvent) -> None:
        raise RuntimeError("the metrics backend is down")

    limiter = create_concurrency_limiter(1, name="broken-listener")
    add_event_listener(broken)
    try:
        with slot(limiter):
            held = limiter.stats().active
        with pytest.raises(ConcurrencyConfigError), slot(limiter, workload="nope"):
            pass
    finally:
        remove_event_listener(broken)
    assert held == 1
    assert limiter.stats().active == 0
    # Listeners after the broken one still hear every event.
    assert events.types(limiter="broken-listener") == ["acquired", "released", "config-error"]


def test_a_removed_listener_hears_nothing_more() -> None:
    heard: list[str] = []

    def listener(event: ConcurrencyEvent) -> None:
        heard.append(event.type)

    limiter = create_concurrency_limiter(1)
    add_event_listener(listener)
    add_event_listener(listener)  # added once
    try:
        with slot(limiter):
            pass
    finally:
        remove_event_listener(listener)
    with slot(limiter):
        pass
    remove_event_listener(listener)  # removing twice is harmless
    assert heard == ["acquired", "released"]


def test_slots_work_without_any_listener(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(DEFAULT_REGISTRY._values, "events.listeners", ())
    assert not has_listeners()
    limiter = create_concurrency_limiter(1)
    with slot(limiter):
        held = limiter.stats().active
    assert held == 1
    assert limiter.stats().active == 0


def test_to_dict_leaves_out_fields_that_do_not_apply(events: EventRecorder) -> None:
    limiter = create_concurrency_limiter(1, name="to-dict")
    with slot(limiter):
        pass
    released = events.of("released", limiter="to-dict")[0].to_dict()
    assert {"lease_id", "hold_ms", "outcome"} <= set(released)
    assert not {"deadline", "wait_ms", "error", "reason", "parent_run_id"} & set(released)
    assert released["type"] == "released"


# -- no secrets in events ------------------------------------------------------------------------

SECRET = "sk-ant-SECRET-PROMPT-1234"


def test_events_never_carry_arguments_or_prompts(
    events: EventRecorder, custom_limiter: CustomFactory, limiter_full: Full
) -> None:
    limiter = custom_limiter(1)

    @guard(limiter=limiter)
    def complete(prompt: str, *, api_key: str) -> str:
        if "fail" in prompt:
            raise ValueError(f"provider rejected {prompt!r} with key {api_key}")
        return prompt

    with run(limiter=limiter):
        assert complete(f"summarize {SECRET}", api_key=SECRET) == f"summarize {SECRET}"
        with pytest.raises(ValueError, match="provider rejected"):
            complete(f"fail {SECRET}", api_key=SECRET)
        with limiter_full(limiter.inner), run(timeout_ms=30), pytest.raises(ConcurrencyError):
            complete(f"wait {SECRET}", api_key=SECRET)
        limiter.release_error = OSError("connection reset")
        complete(f"again {SECRET}", api_key=SECRET)

    seen = events.types(limiter=limiter.name)
    assert {"acquired", "released", "release-failed", "wait-started", "timed-out"} <= set(seen)
    for event in events.events:
        for field in fields(event):
            assert SECRET not in repr(getattr(event, field.name)), (event.type, field.name)


@pytest.mark.parametrize(
    ("message", "shown"),
    [
        (
            "could not connect to postgresql://runcell:hunter2@db:5432/prod",
            "could not connect to postgresql://runcell:***@db:5432/prod",
        ),
        (
            "redis://:hunter2@localhost:6379/0 refused",
            "redis://:***@localhost:6379/0 refused",
        ),
        (
            "host=db user=runcell password=hunter2 dbname=prod",
            "host=db user=runcell password=*** dbname=prod",
        ),
        ("bad api_key=hunter2", "bad api_key=***"),
        ("bad API-KEY: hunter2", "bad API-KEY: ***"),
        ("token=hunter2 expired", "token=*** expired"),
        ("{'password': 'hunter2', 'host': 'db'}", "{'password': ***, 'host': 'db'}"),
    ],
)
def test_describe_error_strips_passwords(message: str, shown: str) -> None:
    described = describe_error(OSError(message))
    assert described == f"OSError: {shown}"
    assert "hunter2" not in described


def test_describe_error_keeps_messages_without_secrets() -> None:
    assert describe_error(ValueError("slot 3 of 'claude' lost")) == (
        "ValueError: slot 3 of 'claude' lost"
    )


def test_describe_error_bounds_the_length() -> None:
    assert len(describe_error(ValueError("x" * 10_000))) == 2_000
