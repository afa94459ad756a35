"""Every public argument of ``slot``, ``guard`` and ``run`` is checked when it is given.

A bad value raises :class:`ConcurrencyConfigError` naming the argument and the value,
never a raw ``TypeError``/``ValueError``/``AttributeError`` from deep inside, and
before any limiter is asked. Limiter and workload names refuse what the database
cannot store (NUL, lone surrogates) wherever limits are built.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest

from runcell_celery import (
    ConcurrencyConfigError,
    create_concurrency_limiter,
    guard,
    slot,
)
from runcell_celery.config import LimiterConfig, WorkloadConfig, limiter_config
from runcell_celery.context import run
from runcell_celery.memory import InMemoryConcurrencyLimiter


@pytest.fixture
def lim() -> InMemoryConcurrencyLimiter:
    return create_concurrency_limiter(1, name="llm")


def _enter_slot(*args: Any, **kwargs: Any) -> Callable[[], None]:
    def call() -> None:
        with slot(*args, **kwargs):
            raise AssertionError("the body must not run")

    return call


def _enter_run(**kwargs: Any) -> Callable[[], None]:
    def call() -> None:
        with run(**kwargs):
            raise AssertionError("the body must not run")

    return call


SLOT_CASES: list[tuple[str, dict[str, Any], str, str]] = [
    ("max_hold_ms", {"max_hold_ms": -1}, "slot(max_hold_ms) = -1", "must be positive"),
    ("max_hold_ms", {"max_hold_ms": 0}, "slot(max_hold_ms) = 0", "must be positive"),
    ("max_hold_ms", {"max_hold_ms": "5"}, "slot(max_hold_ms) = '5'", "must be a number"),
    ("max_hold_ms", {"max_hold_ms": math.nan}, "slot(max_hold_ms) = nan", "must be a number"),
    ("max_hold_ms", {"max_hold_ms": math.inf}, "slot(max_hold_ms) = inf", "use None"),
    ("max_hold_ms", {"max_hold_ms": True}, "slot(max_hold_ms) = True", "must be a number"),
    ("workload", {"workload": 3}, "slot(workload) = 3", "non-empty string"),
    ("workload", {"workload": " "}, "slot(workload) = ' '", "non-empty string"),
    ("key", {"key": ""}, "slot(key) = ''", "empty or blank"),
    ("key", {"key": 42}, "slot(key) = 42", "must be a string"),
    ("key", {"key": "a\x00b"}, "slot(key) = 'a\\x00b'", "control characters"),
    ("key", {"key": "k" * 129}, repr("k" * 129), "at most 128 characters"),
    ("key", {"key": "k" * 3000}, "(3000 characters)", "at most 128 characters"),
    ("cancel", {"cancel": "stop"}, "slot(cancel) = 'stop'", "CancellationToken"),
    ("request_id", {"request_id": ""}, "slot(request_id) = ''", "non-empty string"),
    ("request_id", {"request_id": 7}, "slot(request_id) = 7", "non-empty string"),
    ("request_id", {"request_id": "r\x00"}, "slot(request_id) = 'r\\x00'", "NUL"),
    ("request_id", {"request_id": "r" * 256}, "slot(request_id) = 'rrr", "at most 255"),
]


@pytest.mark.parametrize(
    ("argument", "kwargs", "shown", "rule"), SLOT_CASES, ids=[c[2] for c in SLOT_CASES]
)
def test_a_bad_slot_argument_is_a_config_error_naming_the_argument_and_the_value(
    lim: InMemoryConcurrencyLimiter, argument: str, kwargs: dict[str, Any], shown: str, rule: str
) -> None:
    with pytest.raises(ConcurrencyConfigError) as caught:
        _enter_slot(lim, **kwargs)()
    assert f"slot({argument})" in caught.value.message
    assert shown in caught.value.message
    assert rule in caught.value.message
    assert lim.stats().active == 0
    assert lim.stats().queued == 0


def test_a_limiter_given_by_name_to_slot_is_a_config_error_not_an_attribute_error(
    lim: InMemoryConcurrencyLimiter,
) -> None:
    with pytest.raises(ConcurrencyConfigError, match=r"slot\(limiters\[1\]\) = 'b' is invalid"):
        _enter_slot(lim, "b")()
    with pytest.raises(ConcurrencyConfigError, match=r"slot\(limiters\[0\]\) = 42 is invalid"):
        _enter_slot(42)()
    assert lim.stats().active == 0


def test_good_slot_arguments_are_still_accepted(lim: InMemoryConcurrencyLimiter) -> None:
    with slot(lim, max_hold_ms=1.5e6, key="acme", request_id="req-1", workload="default") as s:
        assert s.lease is not None


GUARD_CASES: list[tuple[dict[str, Any], str]] = [
    ({"limiter": "claude"}, "guard(limiter) = 'claude'"),
    ({"limiter": [create_concurrency_limiter(1, name="a"), "b"]}, "guard(limiter)[1] = 'b'"),
    ({"max_hold_ms": -1}, "guard(max_hold_ms) = -1"),
    ({"max_hold_ms": "5"}, "guard(max_hold_ms) = '5'"),
    ({"workload": ""}, "guard(workload) = ''"),
    ({"key": "a\x00b"}, "guard(key) = 'a\\x00b'"),
]


@pytest.mark.parametrize(("kwargs", "shown"), GUARD_CASES, ids=[c[1] for c in GUARD_CASES])
def test_a_bad_guard_argument_is_refused_when_decorating(
    kwargs: dict[str, Any], shown: str
) -> None:
    with pytest.raises(ConcurrencyConfigError) as caught:
        guard(**kwargs)
    assert shown in caught.value.message


def test_guard_refuses_to_decorate_what_is_not_callable() -> None:
    with pytest.raises(ConcurrencyConfigError, match=r"guard\(fn\) = 5 is invalid"):
        guard(5)  # type: ignore[call-overload]


RUN_CASES: list[tuple[dict[str, Any], str, str]] = [
    ({"timeout_ms": "5"}, "run(timeout_ms) = '5'", "must be a number"),
    ({"timeout_ms": -1}, "run(timeout_ms) = -1", "must not be negative"),
    ({"timeout_ms": math.nan}, "run(timeout_ms) = nan", "must be a number"),
    ({"deadline": 12.0}, "run(deadline) = 12.0", "must be a Deadline"),
    ({"deadline_at": math.nan}, "run(deadline_at) = nan", "finite Unix time"),
    ({"deadline_at": "1700000000"}, "run(deadline_at) = '1700000000'", "finite Unix time"),
    ({"deadline_at": True}, "run(deadline_at) = True", "finite Unix time"),
    ({"cancel": 1}, "run(cancel) = 1", "CancellationToken"),
    ({"run_id": ""}, "run(run_id) = ''", "non-empty string"),
    ({"root_run_id": "r\x00"}, "run(root_run_id) = 'r\\x00'", "NUL"),
    ({"parent_run_id": 5}, "run(parent_run_id) = 5", "non-empty string"),
    ({"name": "x" * 256}, "run(name) = 'xxx", "at most 255"),
    ({"admission": object()}, "run(admission) = <object", "must be an Admission"),
    ({"limiter": "claude"}, "run(limiter) = 'claude'", "must be a limiter"),
    ({"workload": ""}, "run(workload) = ''", "non-empty string"),
    ({"default_workload": 5}, "run(default_workload) = 5", "non-empty string"),
    ({"key": ""}, "run(key) = ''", "empty or blank"),
    ({"key": "k" * 3000}, "run(key) = 'kkkkkkkkkkkkkkkk'… (3000 characters)", "at most 128"),
]


@pytest.mark.parametrize(("kwargs", "shown", "rule"), RUN_CASES, ids=[c[1] for c in RUN_CASES])
def test_a_bad_run_argument_is_a_config_error_naming_the_argument_and_the_value(
    kwargs: dict[str, Any], shown: str, rule: str
) -> None:
    with pytest.raises(ConcurrencyConfigError) as caught:
        _enter_run(**kwargs)()
    assert shown in caught.value.message
    assert rule in caught.value.message


def test_a_run_limiter_list_names_the_bad_item(lim: InMemoryConcurrencyLimiter) -> None:
    with pytest.raises(ConcurrencyConfigError, match=r"run\(limiter\[1\]\) = 'b' is invalid"):
        _enter_run(limiter=[lim, "b"])()


def test_a_key_error_shows_the_keys_shape_not_the_whole_key() -> None:
    with pytest.raises(ConcurrencyConfigError) as caught:
        _enter_run(key="k" * 3000)()
    assert len(caught.value.message) < 200
    assert "3000 characters" in caught.value.message


@pytest.mark.parametrize(
    "name", ["a\x00b", "tab\there", "lone\ud800surrogate"], ids=["nul", "tab", "surrogate"]
)
def test_a_limiter_name_the_database_cannot_store_is_refused_everywhere_limits_are_built(
    name: str,
) -> None:
    for build in (
        lambda: create_concurrency_limiter(1, name=name),
        lambda: limiter_config(1, name=name),
        lambda: LimiterConfig(max_concurrent=1, name=name),
        lambda: LimiterConfig.from_mapping({"max_concurrent": 1}, name=name),
    ):
        with pytest.raises(ConcurrencyConfigError, match="must not contain control characters"):
            build()


def test_a_workload_name_the_database_cannot_store_is_refused() -> None:
    with pytest.raises(ConcurrencyConfigError, match=r'workloads\["a\\x00"\]'):
        LimiterConfig(max_concurrent=1, workloads={"a\x00": WorkloadConfig()})
    with pytest.raises(ConcurrencyConfigError, match="must not contain control characters"):
        limiter_config(1, name="llm", workloads={"ok": {}}, default_workload="ok\x00")


def test_names_with_unicode_letters_stay_valid() -> None:
    assert create_concurrency_limiter(1, name="modèle-é 日本").name == "modèle-é 日本"
