"""A limiter named like a key of a keyed limiter is refused when limiters are
registered, in either order, naming both (``"tenant:acme"`` and a keyed ``"tenant"``
would be one limiter, so ``tenant.key("acme")`` could never be used)."""

from __future__ import annotations

import pytest

from runcell_celery import ConcurrencyConfigError, create_concurrency_limiter
from runcell_celery.registry import LimiterRegistry

PLAIN = {"max_concurrent": 1}
KEYED = {"max_concurrent": 2, "keyed": True}


def _settings(limiters: dict[str, dict[str, object]]) -> dict[str, object]:
    return {"BACKEND": "memory", "LIMITERS": limiters}


@pytest.mark.parametrize(
    "limiters",
    [{"tenant:acme": PLAIN, "tenant": KEYED}, {"tenant": KEYED, "tenant:acme": PLAIN}],
    ids=["plain-first", "keyed-first"],
)
def test_settings_with_a_limiter_named_like_a_key_are_refused_naming_both(
    limiters: dict[str, dict[str, object]],
) -> None:
    registry = LimiterRegistry()
    with pytest.raises(ConcurrencyConfigError) as caught:
        registry.configure(_settings(limiters), path="RUNCELL")
    message = caught.value.message
    assert message.startswith('RUNCELL["LIMITERS"]: ')
    assert "limiter 'tenant:acme'" in message
    assert "keyed limiter 'tenant'" in message
    assert registry.names() == []


def test_a_keyed_limiter_registered_in_code_after_a_plain_one_named_like_its_key_is_refused() -> (
    None
):
    registry = LimiterRegistry()
    registry.configure(_settings({"tenant:acme": PLAIN}))
    tenant = create_concurrency_limiter(2, name="tenant", keyed=True)
    with pytest.raises(ConcurrencyConfigError, match=r"'tenant:acme'.*keyed limiter 'tenant'"):
        registry.register(tenant)
    assert registry.names() == ["tenant:acme"]


def test_a_plain_limiter_registered_in_code_after_a_keyed_one_is_refused() -> None:
    registry = LimiterRegistry()
    registry.register(create_concurrency_limiter(2, name="tenant", keyed=True))
    with pytest.raises(ConcurrencyConfigError, match=r"'tenant:acme'.*keyed limiter 'tenant'"):
        registry.register(create_concurrency_limiter(1, name="tenant:acme"))
    with pytest.raises(ConcurrencyConfigError, match=r"'tenant:acme'.*keyed limiter 'tenant'"):
        registry.configure(_settings({"tenant:acme": PLAIN}))
    assert registry.names() == ["tenant"]


def test_limiters_that_only_look_alike_are_accepted() -> None:
    registry = LimiterRegistry()
    registry.configure(
        _settings({"tenant:acme": PLAIN, "tenant": PLAIN, "tenants": KEYED, "org": KEYED})
    )
    registry.register(create_concurrency_limiter(1, name="tenantx:acme"))
    assert registry.get("tenants").name == "tenants"
    assert registry.names() == ["org", "tenant", "tenant:acme", "tenants", "tenantx:acme"]
