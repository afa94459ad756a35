"""Keys of a keyed limiter: validation, the key's limiter name and its limits."""

from __future__ import annotations

import pytest

from runcell_celery import ConcurrencyConfigError
from runcell_celery.config import LimiterConfig, limiter_config
from runcell_celery.keys import (
    MAX_KEY_LENGTH,
    check_fair_key,
    check_key,
    check_key_clashes,
    config_for_key,
    describe_key,
    key_limiter_name,
    split_key_name,
)


def test_a_key_limiter_is_named_after_the_keyed_limiter_and_the_key() -> None:
    assert key_limiter_name("tenant", "acme") == "tenant:acme"
    assert split_key_name("tenant:acme") == ("tenant", "acme")
    assert split_key_name("tenant:org:42") == ("tenant", "org:42")  # keys may hold ":"
    assert split_key_name("openai") == ("openai", None)


@pytest.mark.parametrize(
    ("key", "words"),
    [
        (42, "must be a string, not int"),
        ("", "empty or blank"),
        ("   ", "empty or blank"),
        ("a" * (MAX_KEY_LENGTH + 1), f"at most {MAX_KEY_LENGTH} characters"),
        ("acme\n", "control characters"),
        ("ac\x00me", "control characters"),
    ],
)
def test_an_invalid_key_is_rejected_naming_the_key_and_the_limiter(key: object, words: str) -> None:
    with pytest.raises(ConcurrencyConfigError) as caught:
        check_key("tenant", key)
    assert words in str(caught.value)
    assert describe_key(key) in str(caught.value)
    assert "'tenant'" in str(caught.value)


def test_a_key_that_would_make_the_name_too_long_is_rejected_with_the_room_left() -> None:
    long_name = "t" * 150
    assert check_key(long_name, "k" * 49) == "k" * 49
    with pytest.raises(ConcurrencyConfigError, match="at most 49"):
        check_key(long_name, "k" * 50)


def test_a_valid_key_is_returned_unchanged() -> None:
    for key in ("acme", "org:42", "ünïcode-tenant", "a" * MAX_KEY_LENGTH):
        assert check_key("tenant", key) == key


def test_a_key_limiter_has_the_keyed_limiters_limits_under_the_keys_name() -> None:
    tenant = limiter_config(
        2, name="tenant", keyed=True, workloads={"interactive": {"reserved": 1}, "batch": {}}
    )
    acme = config_for_key(tenant, "acme")
    assert acme.name == "tenant:acme"
    assert not acme.keyed
    assert acme.max_concurrent == 2
    assert acme.workloads == tenant.workloads


def test_only_a_keyed_limiter_has_keys() -> None:
    with pytest.raises(ConcurrencyConfigError, match="not keyed"):
        config_for_key(limiter_config(2, name="openai"), "acme")


def test_keyed_is_a_limiter_option_that_must_be_a_bool() -> None:
    assert LimiterConfig.from_mapping({"max_concurrent": 2, "keyed": True}, name="t").keyed
    with pytest.raises(
        ConcurrencyConfigError, match="keyed = 'yes' is invalid: must be True or False"
    ):
        LimiterConfig.from_mapping({"max_concurrent": 2, "keyed": "yes"}, name="t")


def test_a_keyed_limiters_name_may_not_contain_the_separator() -> None:
    with pytest.raises(ConcurrencyConfigError, match="must not contain ':'"):
        limiter_config(2, name="tenant:eu", keyed=True)
    assert limiter_config(2, name="tenant:eu").name == "tenant:eu"  # unkeyed: fine


def test_keyed_is_stored_only_when_set_so_existing_hashes_do_not_change() -> None:
    assert "keyed" not in limiter_config(2, name="openai").to_dict()
    assert limiter_config(2, name="tenant", keyed=True).to_dict()["keyed"] is True
    assert limiter_config(2, name="t").differences(limiter_config(2, name="t", keyed=True)) == [
        "keyed"
    ]


def test_a_long_key_is_shown_by_its_start_and_its_length_not_whole() -> None:
    with pytest.raises(ConcurrencyConfigError) as caught:
        check_key("tenant", "k" * 3000)
    assert "'kkkkkkkkkkkkkkkk'… (3000 characters)" in caught.value.message
    assert len(caught.value.message) < 200


def test_a_fairness_key_follows_the_key_rules_without_a_limiters_name() -> None:
    assert check_fair_key("a" * MAX_KEY_LENGTH, argument="slot(key)") == "a" * MAX_KEY_LENGTH
    for bad, rule in (("", "empty"), ("a\x00", "NUL"), ("a\ud800", "surrogates"), (1, "string")):
        with pytest.raises(ConcurrencyConfigError, match=r"^slot\(key\) = .* is invalid") as caught:
            check_fair_key(bad, argument="slot(key)")
        assert rule in caught.value.message


def test_a_limiter_named_like_a_key_of_a_keyed_limiter_is_refused_in_either_order() -> None:
    for limiters in (
        {"tenant:acme": False, "tenant": True},
        {"tenant": True, "tenant:acme": False},
    ):
        with pytest.raises(ConcurrencyConfigError) as caught:
            check_key_clashes(limiters, where='RUNCELL["LIMITERS"]')
        assert "'tenant:acme'" in caught.value.message
        assert "keyed limiter 'tenant'" in caught.value.message
    check_key_clashes({"tenant:acme": False, "tenant": False})  # neither keyed: two limiters
