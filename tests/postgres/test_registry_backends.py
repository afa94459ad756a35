"""The registry's table of backends: chosen by name, built once per process."""

from __future__ import annotations

import re

import pytest

from runcell_celery import ConcurrencyConfigError, InMemoryConcurrencyLimiter
from runcell_celery.backends import BACKENDS, MemoryBackend
from runcell_celery.postgres import PostgresBackend, PostgresConcurrencyLimiter
from runcell_celery.registry import LimiterRegistry
from tests.support.pg import unique_name


def _limiters(*names: str) -> dict[str, dict[str, int]]:
    return {name: {"max_concurrent": 2} for name in names}


def test_an_unknown_backend_is_refused_with_the_name_meant() -> None:
    with pytest.raises(ConcurrencyConfigError) as caught:
        LimiterRegistry().configure({"BACKEND": "postgress", "LIMITERS": {}})
    assert str(caught.value) == (
        "RUNCELL[\"BACKEND\"] = 'postgress' is invalid: did you mean 'postgres'? "
        "valid: 'memory', 'postgres'"
    )


def test_the_backend_table_names_each_backend_class() -> None:
    assert set(BACKENDS) == {"postgres", "memory"}
    registry = LimiterRegistry()
    registry.configure({"BACKEND": "memory", "LIMITERS": _limiters("a")})
    assert isinstance(registry.backend, MemoryBackend)
    assert isinstance(registry.get("a"), InMemoryConcurrencyLimiter)


def test_the_postgres_options_are_checked_when_the_registry_is_configured() -> None:
    settings = {"DATABASE": "postgresql://nobody@127.0.0.1:1/none", "POSTGRES": {"listn": True}}
    message = (
        'app.conf.runcell["POSTGRES"]["listn"] is invalid: unknown option; did you mean \'listen\'?'
    )
    with pytest.raises(ConcurrencyConfigError, match=re.escape(message)):
        LimiterRegistry().configure(settings, path="app.conf.runcell")


def test_all_limiters_of_a_registry_share_one_backend_and_its_pool(pg_dsn: str) -> None:
    first, second = unique_name("shared"), unique_name("shared")
    registry = LimiterRegistry()
    registry.configure(
        {
            "DATABASE": pg_dsn,
            "LIMITERS": _limiters(first, second),
            "POSTGRES": {"listen": False, "pool_max_size": 3},
        }
    )
    backend = registry.backend
    assert isinstance(backend, PostgresBackend)
    assert registry.backend is backend, "built once per process"
    limiters = [registry.get(first), registry.get(second)]
    for limiter in limiters:
        assert isinstance(limiter, PostgresConcurrencyLimiter)
        assert limiter.pool is backend.pool
        assert limiter.options is backend.options
    assert backend.options.pool_max_size == 3
    assert set(backend.stored_limits([first, second])) == {first, second}


def test_the_database_setting_is_resolved_when_the_backend_is_built(pg_dsn: str) -> None:
    resolved: list[str] = []

    def resolve(alias: str) -> str:
        resolved.append(alias)
        return pg_dsn

    registry = LimiterRegistry(resolve_database=resolve)
    registry.configure({"DATABASE": "default", "LIMITERS": _limiters(unique_name())})
    assert resolved == [], "configuring opens and resolves nothing"
    assert isinstance(registry.backend, PostgresBackend)
    assert resolved == ["default"]


def test_a_registry_without_a_database_has_no_postgres_backend() -> None:
    registry = LimiterRegistry()
    assert registry.backend is None
    registry.configure({"LIMITERS": {}})
    assert registry.backend is None
