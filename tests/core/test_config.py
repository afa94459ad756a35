"""Limiter and workload settings: every invalid one is refused, naming field and value."""

from __future__ import annotations

import hashlib
import json
import re
from typing import TYPE_CHECKING, Any

import pytest

from runcell_celery import (
    AcquireRequest,
    ConcurrencyConfigError,
    InMemoryConcurrencyLimiter,
    Lease,
    LimiterConfig,
    RunLineage,
    WorkloadConfig,
    create_concurrency_limiter,
    run,
    slot,
)
from runcell_celery.config import DEFAULT_LEASE_TTL_MS, check_duration_ms, limiter_config

if TYPE_CHECKING:
    from tests.conftest import EventRecorder

CLAUDE = 'RUNCELL["LIMITERS"]["claude"]'


def config_error(options: dict[str, Any], *, path: str = "") -> ConcurrencyConfigError:
    """Build a limiter from settings and return the error it must raise."""
    with pytest.raises(ConcurrencyConfigError) as caught:
        LimiterConfig.from_mapping(options, path=path)
    return caught.value


# -- reservations and ceilings ----------------------------------------------------------


def test_reservations_adding_up_to_more_than_max_concurrent_are_refused() -> None:
    error = config_error(
        {
            "max_concurrent": 4,
            "workloads": {"interactive": {"reserved": 3}, "realtime": {"reserved": 2}},
        }
    )
    message = str(error)
    assert message.startswith("workloads = 5 is invalid")
    assert "interactive 3 + realtime 2" in message
    assert "max_concurrent (4)" in message


def test_reservations_exactly_filling_max_concurrent_are_accepted() -> None:
    config = LimiterConfig.from_mapping(
        {"max_concurrent": 4, "workloads": {"a": {"reserved": 3}, "b": {"reserved": 1}}}
    )
    assert sum(w.reserved for w in config.workloads.values()) == config.max_concurrent


def test_a_workload_ceiling_above_the_limiters_is_refused() -> None:
    error = config_error({"max_concurrent": 8, "workloads": {"background": {"max_concurrent": 10}}})
    assert str(error).startswith('workloads["background"]["max_concurrent"] = 10 is invalid')
    assert "limiter's max_concurrent (8)" in str(error)


def test_a_reservation_above_the_workloads_own_ceiling_is_refused() -> None:
    error = config_error(
        {"max_concurrent": 8, "workloads": {"batch": {"max_concurrent": 2, "reserved": 3}}}
    )
    assert str(error).startswith('workloads["batch"]["reserved"] = 3 is invalid')
    assert "workload's own max_concurrent (2)" in str(error)


def test_a_reservation_above_the_limiters_max_concurrent_is_refused() -> None:
    error = config_error({"max_concurrent": 2, "workloads": {"only": {"reserved": 3}}})
    assert str(error).startswith('workloads["only"]["reserved"] = 3 is invalid')
    assert "max_concurrent (2)" in str(error)


def test_a_workload_config_object_checks_its_own_reservation() -> None:
    with pytest.raises(ConcurrencyConfigError, match=r"^reserved = 5 is invalid"):
        WorkloadConfig(max_concurrent=4, reserved=5)


# -- types and ranges ---------------------------------------------------------------------

NOT_INTEGERS = [True, False, 2.0, 2.5, "8", None, [8]]


@pytest.mark.parametrize("value", NOT_INTEGERS, ids=repr)
def test_max_concurrent_must_be_an_integer(value: object) -> None:
    error = config_error({"max_concurrent": value})
    assert str(error) == f"max_concurrent = {value!r} is invalid: must be an integer"


@pytest.mark.parametrize("field", ["max_queued", "lease_ttl_ms", "max_hold_ms"])
@pytest.mark.parametrize("value", [True, 1.5, "100"], ids=repr)
def test_limiter_options_must_be_integers(field: str, value: object) -> None:
    error = config_error({"max_concurrent": 4, field: value})
    assert str(error) == f"{field} = {value!r} is invalid: must be an integer"


@pytest.mark.parametrize("field", ["max_concurrent", "reserved", "priority", "max_wait_ms"])
@pytest.mark.parametrize("value", [True, 1.0, "2"], ids=repr)
def test_workload_options_must_be_integers(field: str, value: object) -> None:
    error = config_error({"max_concurrent": 4, "workloads": {"interactive": {field: value}}})
    assert str(error) == (
        f'workloads["interactive"]["{field}"] = {value!r} is invalid: must be an integer'
    )


@pytest.mark.parametrize("value", [0, -1])
@pytest.mark.parametrize("field", ["max_concurrent", "lease_ttl_ms", "max_hold_ms"])
def test_counts_and_durations_that_must_be_positive_refuse_zero_and_negatives(
    field: str, value: int
) -> None:
    options: dict[str, Any] = {"max_concurrent": 4, field: value}
    error = config_error(options)
    assert str(error) == f"{field} = {value} is invalid: must be a positive integer"


def test_max_queued_refuses_negatives_but_allows_zero() -> None:
    error = config_error({"max_concurrent": 4, "max_queued": -1})
    assert str(error) == "max_queued = -1 is invalid: must be at least 0"
    assert LimiterConfig(max_concurrent=4, max_queued=0).max_queued == 0


@pytest.mark.parametrize("field", ["reserved", "max_wait_ms"])
def test_workload_reserved_and_max_wait_refuse_negatives(field: str) -> None:
    error = config_error({"max_concurrent": 4, "workloads": {"interactive": {field: -1}}})
    assert str(error) == (
        f'workloads["interactive"]["{field}"] = -1 is invalid: must be at least 0'
    )


def test_a_workload_ceiling_of_zero_is_refused() -> None:
    error = config_error({"max_concurrent": 4, "workloads": {"off": {"max_concurrent": 0}}})
    assert str(error) == (
        'workloads["off"]["max_concurrent"] = 0 is invalid: must be a positive integer'
    )


def test_negative_priorities_are_allowed() -> None:
    config = LimiterConfig.from_mapping(
        {"max_concurrent": 2, "workloads": {"low": {"priority": -5}}}
    )
    assert config.workloads["low"].priority == -5


@pytest.mark.parametrize("name", ["", "   ", None, 7])
def test_the_limiter_name_must_be_a_non_empty_string(name: object) -> None:
    error = config_error({"max_concurrent": 1, "name": name})
    assert str(error) == f"name = {name!r} is invalid: must be a non-empty string"


def test_workload_names_must_be_non_empty_strings() -> None:
    error = config_error({"max_concurrent": 1, "workloads": {"": {}}})
    assert str(error) == "workloads[\"\"] = '' is invalid: must be a non-empty string"


def test_a_workloads_settings_must_be_a_dict() -> None:
    error = config_error({"max_concurrent": 1, "workloads": {"a": 3}})
    assert str(error) == 'workloads["a"] = 3 is invalid: a workload\'s settings must be a dict'


# -- names that do not exist ----------------------------------------------------------------


def test_a_default_workload_that_does_not_exist_is_refused_with_a_hint() -> None:
    error = config_error(
        {
            "max_concurrent": 4,
            "workloads": {"interactive": {}, "background": {}},
            "default_workload": "backgruond",
        }
    )
    assert str(error) == (
        "default_workload = 'backgruond' is invalid: no such workload; "
        "did you mean 'background'? valid: 'background', 'interactive'"
    )


def test_an_unknown_limiter_option_is_refused_with_a_hint() -> None:
    error = config_error({"max_concurent": 8})
    assert str(error).startswith("max_concurent = 8 is invalid: unknown option")
    assert "did you mean 'max_concurrent'" in str(error)


def test_an_unknown_workload_option_is_refused_with_a_hint() -> None:
    error = config_error(
        {"max_concurrent": 8, "workloads": {"interactive": {"reserverd": 2}}}, path=CLAUDE
    )
    assert str(error).startswith(
        f'{CLAUDE}["workloads"]["interactive"]["reserverd"] = 2 is invalid: unknown option'
    )
    assert "did you mean 'reserved'" in str(error)


def test_an_unknown_workload_option_given_to_the_factory_is_refused() -> None:
    with pytest.raises(ConcurrencyConfigError, match="did you mean 'max_wait_ms'"):
        create_concurrency_limiter(2, workloads={"interactive": {"max_wait": 10}})


def test_an_option_with_no_close_match_lists_the_valid_ones() -> None:
    error = config_error({"max_concurrent": 8, "flavour": "vanilla"})
    assert "did you mean" not in str(error)
    valid = "valid: 'claim_window_ms', 'default_workload', 'fairness', 'keyed', 'lease_ttl_ms'"
    assert valid in str(error)


def test_an_empty_workloads_dict_is_refused() -> None:
    error = config_error({"max_concurrent": 8, "workloads": {}})
    assert str(error) == (
        "workloads = {} is invalid: name at least one workload, or omit it for 'default'"
    )


def test_workloads_that_are_not_a_dict_are_refused() -> None:
    error = config_error({"max_concurrent": 8, "workloads": ["interactive"]})
    assert "must be a dict of workload name to settings" in str(error)


def test_a_limiter_without_max_concurrent_is_refused() -> None:
    error = config_error({"max_queued": 10}, path=CLAUDE)
    assert str(error) == f'{CLAUDE}["max_concurrent"] = None is invalid: is required'


def test_a_name_option_that_disagrees_with_its_settings_key_is_refused() -> None:
    with pytest.raises(ConcurrencyConfigError) as caught:
        LimiterConfig.from_mapping({"max_concurrent": 1, "name": "gpt"}, name="claude", path=CLAUDE)
    assert str(caught.value) == (
        f"{CLAUDE}[\"name\"] = 'gpt' is invalid: must match the settings key 'claude'"
    )


def test_settings_that_are_not_a_dict_are_refused_naming_the_settings_path() -> None:
    error = config_error(8, path=CLAUDE)  # type: ignore[arg-type]
    assert str(error) == f"{CLAUDE} = 8 is invalid: a limiter's settings must be a dict"


# -- the settings path in messages -------------------------------------------------------------


def test_errors_in_django_settings_name_the_full_settings_path() -> None:
    error = config_error(
        {
            "max_concurrent": 8,
            "workloads": {
                "interactive": {"reserved": 9, "priority": 10},
                "background": {"max_concurrent": 6},
            },
        },
        path=CLAUDE,
    )
    assert str(error) == (
        f'{CLAUDE}["workloads"]["interactive"]["reserved"] = 9 is invalid: '
        "must not exceed the limiter's max_concurrent (8)"
    )


@pytest.mark.parametrize(
    ("options", "shown"),
    [
        ({"max_concurrent": 0}, f'{CLAUDE}["max_concurrent"] = 0'),
        ({"max_concurrent": 4, "lease_ttl_ms": -5}, f'{CLAUDE}["lease_ttl_ms"] = -5'),
        (
            {"max_concurrent": 4, "workloads": {"bg": {"max_concurrent": 5}}},
            f'{CLAUDE}["workloads"]["bg"]["max_concurrent"] = 5',
        ),
        (
            {"max_concurrent": 4, "workloads": {"bg": {"max_wait_ms": "soon"}}},
            f'{CLAUDE}["workloads"]["bg"]["max_wait_ms"] = \'soon\'',
        ),
        ({"max_concurrent": 4, "workloads": {}}, f'{CLAUDE}["workloads"] = {{}}'),
        (
            {"max_concurrent": 2, "workloads": {"a": {"reserved": 2}, "b": {"reserved": 1}}},
            f'{CLAUDE}["workloads"] = 3',
        ),
        (
            {"max_concurrent": 2, "workloads": {"a": {}, "b": {}}, "default_workload": "c"},
            f"{CLAUDE}[\"default_workload\"] = 'c'",
        ),
    ],
)
def test_every_kind_of_error_starts_with_the_settings_path(
    options: dict[str, Any], shown: str
) -> None:
    error = config_error(options, path=CLAUDE)
    assert str(error).startswith(f"{shown} is invalid: ")


def test_the_factory_raises_the_same_error_as_settings() -> None:
    with pytest.raises(ConcurrencyConfigError) as caught:
        create_concurrency_limiter(4, workloads={"a": {"reserved": 3}, "b": {"reserved": 2}})
    assert str(caught.value) == str(
        config_error(
            {"max_concurrent": 4, "workloads": {"a": {"reserved": 3}, "b": {"reserved": 2}}}
        )
    )


# -- valid settings and their defaults -------------------------------------------------------


def test_omitted_workloads_mean_one_default_workload_with_the_limiters_ceiling() -> None:
    config = LimiterConfig(max_concurrent=5)
    assert dict(config.workloads) == {"default": WorkloadConfig(max_concurrent=5)}
    assert config.default_workload == "default"
    assert config.name == "default"
    assert config.lease_ttl_ms == DEFAULT_LEASE_TTL_MS == 30_000
    assert config.max_queued is None
    assert config.max_hold_ms is None


def test_a_workload_without_a_ceiling_gets_the_limiters() -> None:
    config = LimiterConfig.from_mapping(
        {"max_concurrent": 8, "workloads": {"interactive": {}, "background": {"max_concurrent": 6}}}
    )
    assert config.ceiling("interactive") == 8
    assert config.ceiling("background") == 6
    assert config.workloads["interactive"] == WorkloadConfig(max_concurrent=8)


def test_the_default_workload_is_default_when_it_exists() -> None:
    config = LimiterConfig.from_mapping(
        {"max_concurrent": 2, "workloads": {"batch": {}, "default": {}}}
    )
    assert config.default_workload == "default"
    assert config.resolve_workload(None) == "default"


def test_the_default_workload_is_the_only_workload() -> None:
    config = LimiterConfig.from_mapping({"max_concurrent": 2, "workloads": {"batch": {}}})
    assert config.default_workload == "batch"
    assert config.resolve_workload(None) == "batch"


def test_an_explicit_default_workload_wins_over_default() -> None:
    config = LimiterConfig.from_mapping(
        {
            "max_concurrent": 2,
            "workloads": {"batch": {}, "default": {}},
            "default_workload": "batch",
        }
    )
    assert config.resolve_workload(None) == "batch"


def test_several_workloads_without_default_have_no_default_workload() -> None:
    config = LimiterConfig.from_mapping(
        {"max_concurrent": 2, "workloads": {"interactive": {}, "background": {}}}
    )
    assert config.default_workload is None
    with pytest.raises(ConcurrencyConfigError, match="must select one") as caught:
        config.resolve_workload(None)
    assert "background, interactive" in str(caught.value)


def test_resolving_an_unknown_workload_names_it_and_suggests_one() -> None:
    config = LimiterConfig.from_mapping(
        {"name": "claude", "max_concurrent": 2, "workloads": {"interactive": {}, "background": {}}}
    )
    with pytest.raises(ConcurrencyConfigError) as caught:
        config.resolve_workload("interactiv")
    error = caught.value
    assert "limiter 'claude' has no workload 'interactiv'" in str(error)
    assert "did you mean 'interactive'" in str(error)
    assert (error.limiter, error.workload) == ("claude", "interactiv")


def test_the_settings_key_names_the_limiter() -> None:
    config = LimiterConfig.from_mapping({"max_concurrent": 3}, name="claude")
    assert config.name == "claude"


def test_to_dict_gives_every_resolved_limit_as_plain_values() -> None:
    config = LimiterConfig.from_mapping(
        {
            "max_concurrent": 8,
            "max_queued": 200,
            "workloads": {
                "interactive": {"reserved": 2, "priority": 10, "max_wait_ms": 60_000},
                "background": {"max_concurrent": 6, "max_wait_ms": 300_000},
            },
        },
        name="claude",
    )
    assert config.to_dict() == {
        "name": "claude",
        "max_concurrent": 8,
        "max_queued": 200,
        "default_workload": None,
        "lease_ttl_ms": 30_000,
        "max_hold_ms": None,
        "workloads": {
            "background": {
                "max_concurrent": 6,
                "reserved": 0,
                "priority": 0,
                "max_wait_ms": 300_000,
            },
            "interactive": {
                "max_concurrent": 8,
                "reserved": 2,
                "priority": 10,
                "max_wait_ms": 60_000,
            },
        },
    }


def test_a_config_rebuilt_from_its_dict_is_equal() -> None:
    config = LimiterConfig.from_mapping(
        {"max_concurrent": 8, "workloads": {"a": {"reserved": 2}, "b": {"max_concurrent": 3}}}
    )
    rebuilt = LimiterConfig.from_mapping(config.to_dict())
    assert rebuilt.to_dict() == config.to_dict()
    assert rebuilt.differences(config) == []


def test_differences_name_each_changed_field_as_a_dotted_path() -> None:
    mine = LimiterConfig.from_mapping(
        {"max_concurrent": 8, "workloads": {"interactive": {"reserved": 2}, "background": {}}}
    )
    theirs = LimiterConfig.from_mapping(
        {
            "max_concurrent": 8,
            "lease_ttl_ms": 10_000,
            "workloads": {"interactive": {"reserved": 3}, "batch": {}},
        }
    )
    assert mine.differences(theirs) == [
        "lease_ttl_ms",
        "workloads.background",
        "workloads.batch",
        "workloads.interactive.reserved",
    ]
    assert mine.differences(mine) == []


def test_a_workload_given_as_config_object_is_accepted_and_resolved() -> None:
    config = LimiterConfig(max_concurrent=3, workloads={"a": WorkloadConfig(reserved=1)})
    assert config.workloads["a"] == WorkloadConfig(max_concurrent=3, reserved=1)


def test_config_workloads_cannot_be_changed_after_validation() -> None:
    config = LimiterConfig(max_concurrent=3, workloads={"a": WorkloadConfig()})
    with pytest.raises(TypeError):
        config.workloads["b"] = WorkloadConfig()  # type: ignore[index]


# -- several workloads and no default: a run must select one, before it waits ------------------


def two_workloads_full() -> tuple[InMemoryConcurrencyLimiter, Lease]:
    """A limiter with two workloads, no default, and its only slot taken."""
    limiter = create_concurrency_limiter(
        1, name="split", workloads={"interactive": {}, "background": {}}
    )
    held = limiter.acquire(AcquireRequest("held", "background", RunLineage("r", "r")))
    return limiter, held


def test_a_run_that_selects_no_workload_fails_when_it_starts(events: EventRecorder) -> None:
    limiter, _held = two_workloads_full()
    with (
        pytest.raises(ConcurrencyConfigError, match="must select one") as caught,
        run(limiter=limiter, timeout_ms=5_000),
    ):
        pytest.fail("the run started without a workload")
    assert caught.value.limiter == "split"
    assert limiter.stats().queued == 0
    assert events.of("wait-started") == []


def test_a_slot_that_selects_no_workload_fails_before_it_waits(events: EventRecorder) -> None:
    limiter, _held = two_workloads_full()
    # The limiter is full: had the slot waited, the run's budget would end it with
    # a timeout instead of the configuration error.
    with (
        run(timeout_ms=2_000),
        pytest.raises(ConcurrencyConfigError, match="must select one"),
        slot(limiter),
    ):
        pytest.fail("the slot was granted without a workload")
    assert limiter.stats().queued == 0
    assert events.types(limiter="split") == ["config-error"]


def test_a_run_that_selects_a_workload_of_a_split_limiter_starts() -> None:
    limiter, held = two_workloads_full()
    with run(limiter=limiter, workload="interactive") as context:
        assert context.workload == "interactive"
    limiter.release(held)


def test_a_run_that_selects_an_unknown_workload_fails_with_a_hint() -> None:
    limiter, _held = two_workloads_full()
    with (
        pytest.raises(ConcurrencyConfigError, match=re.escape("did you mean 'background'")),
        run(limiter=limiter, workload="backgound"),
    ):
        pytest.fail("the run started with an unknown workload")


@pytest.mark.parametrize(
    ("options", "path"),
    [
        ({"max_concurrent": 2**31}, "max_concurrent"),
        ({"max_concurrent": 2, "max_queued": 2**31}, "max_queued"),
        ({"max_concurrent": 2, "lease_ttl_ms": 2**31}, "lease_ttl_ms"),
        ({"max_concurrent": 2, "max_hold_ms": 10**20}, "max_hold_ms"),
        (
            {"max_concurrent": 2, "workloads": {"a": {"max_wait_ms": 2**31}}},
            'workloads"]["a"]["max_wait_ms',
        ),
        (
            {"max_concurrent": 2, "workloads": {"a": {"priority": 2**31}}},
            'workloads"]["a"]["priority',
        ),
        (
            {"max_concurrent": 2, "workloads": {"a": {"priority": -(2**31) - 1}}},
            'workloads"]["a"]["priority',
        ),
    ],
)
def test_numbers_past_what_the_database_stores_are_rejected_naming_field_and_bound(
    options: dict[str, Any], path: str
) -> None:
    with pytest.raises(ConcurrencyConfigError) as caught:
        LimiterConfig.from_mapping(options, path='RUNCELL["LIMITERS"]["x"]')
    message = str(caught.value)
    assert path in message
    assert "must be at most 2147483647" in message or "must be at least -2147483648" in message


def test_a_duration_at_the_bound_is_accepted() -> None:
    config = LimiterConfig.from_mapping({"max_concurrent": 2**31 - 1, "lease_ttl_ms": 2**31 - 1})
    assert config.lease_ttl_ms == 2**31 - 1


@pytest.mark.parametrize("value", [float("inf"), 1e300, float("nan"), -1, 0, 2**31])
def test_a_duration_in_code_names_the_field_and_the_longest_allowed(value: float) -> None:
    with pytest.raises(ConcurrencyConfigError, match=r"^timeout_ms = .* is invalid: must be"):
        check_duration_ms(value, field="timeout_ms")


# -- fairness ------------------------------------------------------------------------------


def test_fairness_defaults_to_fifo_and_round_robin_is_accepted_from_settings() -> None:
    assert LimiterConfig(max_concurrent=2).fairness == "fifo"
    config = LimiterConfig.from_mapping(
        {"max_concurrent": 1, "fairness": "round_robin"}, name="openai"
    )
    assert config.fairness == "round_robin"
    assert limiter_config(1, fairness="round_robin").fairness == "round_robin"


@pytest.mark.parametrize(
    ("value", "hint"),
    [
        ("roundrobin", "did you mean 'round_robin'? "),
        ("FIFO", ""),
        ("", ""),
        (None, ""),
        (1, ""),
    ],
)
def test_an_unknown_fairness_is_refused_naming_the_field_the_value_and_the_choices(
    value: object, hint: str
) -> None:
    error = config_error({"max_concurrent": 1, "fairness": value}, path=CLAUDE)
    assert str(error) == (
        f'{CLAUDE}["fairness"] = {value!r} is invalid: unknown fairness; '
        f"{hint}valid: 'fifo', 'round_robin'"
    )


def test_a_fairness_given_in_code_is_checked_too() -> None:
    with pytest.raises(ConcurrencyConfigError, match=r"fairness = 'lifo' is invalid"):
        LimiterConfig(max_concurrent=1, fairness="lifo")  # type: ignore[arg-type]


def test_fifo_limits_keep_the_form_and_hash_they_were_stored_with() -> None:
    # Hashes of these limits as stored before fairness existed: a worker upgraded to
    # a version with fairness must agree with the rows older workers wrote.
    plain = LimiterConfig(max_concurrent=8, name="claude")
    split = LimiterConfig.from_mapping(
        {
            "max_concurrent": 8,
            "max_queued": 200,
            "workloads": {
                "interactive": {"reserved": 2, "priority": 10},
                "background": {"max_concurrent": 6},
            },
        },
        name="claude",
    )
    assert "fairness" not in plain.to_dict()
    assert _stored_hash(plain) == (
        "0b7922728dd177d9d9a65df68ba80671484bf3db785f136f778e342317f70235"
    )
    assert _stored_hash(split) == (
        "26947d1dc17aac4637bb2b95e25e55fd03131d9e5c1e2d7e4c64ea6bd441df80"
    )
    assert _stored_hash(LimiterConfig(max_concurrent=8, name="claude", fairness="fifo")) == (
        _stored_hash(plain)
    )


def test_round_robin_is_stored_compared_and_rebuilt() -> None:
    fair = LimiterConfig(max_concurrent=8, name="claude", fairness="round_robin")
    plain = LimiterConfig(max_concurrent=8, name="claude")
    assert fair.to_dict()["fairness"] == "round_robin"
    assert _stored_hash(fair) != _stored_hash(plain)
    assert fair.differences(plain) == ["fairness"]
    assert LimiterConfig.from_mapping(fair.to_dict()) == fair


def _stored_hash(config: LimiterConfig) -> str:
    """The hash the PostgreSQL limiter stores and compares (``config_hash``)."""
    canonical = json.dumps(config.to_dict(), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()
