"""``settings.RUNCELL``: validated at startup by the core, shared with Celery."""

from __future__ import annotations

import copy
import re
from typing import Any

import psycopg
import pytest
from django.apps import apps
from django.conf import settings as django_settings

from runcell_celery import ConcurrencyConfigError
from runcell_celery.postgres import PostgresConcurrencyLimiter
from runcell_django import conf, get_limiter


def _runcell(**changes: Any) -> dict[str, Any]:
    value = copy.deepcopy(django_settings.RUNCELL)
    value.update(changes)
    return value


def test_a_bad_workload_setting_is_named_by_its_path_in_runcell(settings: Any) -> None:
    settings.RUNCELL = _runcell(
        LIMITERS={
            "claude": {
                "max_concurrent": 8,
                "workloads": {"interactive": {"reserved": 9}, "background": {}},
            }
        }
    )
    path = 'RUNCELL["LIMITERS"]["claude"]["workloads"]["interactive"]["reserved"] = 9 is invalid'
    with pytest.raises(ConcurrencyConfigError, match=re.escape(path)):
        conf.validate()


def test_invalid_settings_are_a_check_error_and_the_limiters_refuse_to_start(
    settings: Any,
) -> None:
    from runcell_django.checks import check_settings

    settings.RUNCELL = _runcell(LIMITERS={"claude": {"max_concurent": 8}})
    apps.get_app_config("runcell_django").ready()  # no traceback: the check reports it
    (error,) = check_settings()
    assert error.id == "runcell_django.E004"
    assert "did you mean 'max_concurrent'" in error.msg
    with pytest.raises(ConcurrencyConfigError, match="did you mean 'max_concurrent'"):
        get_limiter("claude")


def test_an_unknown_setting_suggests_the_one_meant(settings: Any) -> None:
    settings.RUNCELL = {"DATABASE": "default", "LIMITER": {}}
    with pytest.raises(ConcurrencyConfigError, match=r"RUNCELL\[\"LIMITER\"\].*'LIMITERS'"):
        conf.validate()


@pytest.mark.parametrize(
    ("events", "message"),
    [
        (
            {"BUFER_SIZE": 10},
            'RUNCELL["EVENTS"]["BUFER_SIZE"] is invalid: unknown option; '
            "did you mean 'BUFFER_SIZE'?",
        ),
        (
            {"BUFFER_SIZE": 0},
            'RUNCELL["EVENTS"]["BUFFER_SIZE"] = 0 is invalid: must be a positive integer',
        ),
        ({"ENABLED": "yes"}, 'RUNCELL["EVENTS"]["ENABLED"] = \'yes\' is invalid: must be True'),
        ({"SAMPLE_INTERVAL_MS": -1}, "must be an integer of at least 0"),
    ],
)
def test_event_options_are_checked_by_name_and_value(
    settings: Any, events: dict[str, Any], message: str
) -> None:
    settings.RUNCELL = _runcell(EVENTS=events)
    with pytest.raises(ConcurrencyConfigError, match=re.escape(message)):
        conf.validate()


def test_event_options_have_defaults(settings: Any) -> None:
    settings.RUNCELL = _runcell(EVENTS={"RETENTION_DAYS": 30})
    options = conf.event_settings()
    assert options.retention_days == 30
    assert options.enabled is True
    assert options.buffer_size == 10_000


def test_a_database_that_is_neither_an_alias_nor_a_dsn_is_rejected(settings: Any) -> None:
    settings.RUNCELL = _runcell(DATABASE="defualt")
    with pytest.raises(ConcurrencyConfigError, match="did you mean 'default'"):
        conf.validate()


@pytest.mark.django_db
def test_a_database_alias_resolves_to_the_dsn_of_that_database() -> None:
    from django.db import connection

    dsn = conf.resolve_database("default")
    assert psycopg.conninfo.conninfo_to_dict(dsn)["dbname"] == connection.settings_dict["NAME"]
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT current_database()").fetchone()
    assert row is not None
    assert row[0] == connection.settings_dict["NAME"]


def test_a_dsn_is_used_as_it_is_and_the_admin_reads_it_as_the_runcell_alias(
    settings: Any,
) -> None:
    from django.db import connections

    dsn = "postgresql://app@db.internal:6432/app?sslmode=require"
    settings.RUNCELL = _runcell(DATABASE=dsn)
    assert conf.registry().database_dsn == dsn
    assert conf.database_alias() == "runcell"
    entry = connections.settings["runcell"]
    assert (entry["NAME"], entry["USER"], entry["HOST"], entry["PORT"]) == (
        "app",
        "app",
        "db.internal",
        "6432",
    )
    assert entry["OPTIONS"] == {"sslmode": "require"}
    settings.RUNCELL = _runcell(DATABASE="default")
    assert conf.database_alias() == "default"
    assert "runcell" not in connections.settings  # forgotten with the setting


def test_a_dsn_is_not_registered_over_an_alias_the_project_defines(settings: Any) -> None:
    from django.db import connections

    connections.settings["runcell"] = dict(connections.settings["default"])
    try:
        settings.RUNCELL = _runcell(DATABASE="postgresql://app@db.internal/app")
        with pytest.raises(ConcurrencyConfigError, match="which DATABASES already defines"):
            conf.database_alias()
    finally:
        del connections.settings["runcell"]


@pytest.mark.django_db
def test_get_limiter_returns_the_configured_limiter_on_the_django_database() -> None:
    from runcell_celery import run, slot
    from runcell_django.models import Lease

    limiter = get_limiter("claude")
    assert isinstance(limiter, PostgresConcurrencyLimiter)
    assert limiter.config.max_concurrent == 3
    assert get_limiter("claude") is limiter
    with run(limiter=limiter, workload="interactive", run_id="task-1"), slot() as held:
        lease = Lease.objects.get()
        assert str(lease.lease_id) == held.lease.lease_id  # type: ignore[union-attr]
        assert lease.run_id == "task-1"


def test_an_unknown_limiter_name_suggests_the_right_one() -> None:
    with pytest.raises(ConcurrencyConfigError, match="did you mean 'claude'"):
        get_limiter("claud")


def test_changed_settings_take_effect_without_a_restart(settings: Any) -> None:
    settings.RUNCELL = _runcell(LIMITERS={"gpt": {"max_concurrent": 4}})
    assert conf.registry().names() == ["gpt"]


def test_celery_reads_the_same_settings_when_its_app_has_none() -> None:
    from celery import Celery

    from runcell_celery.celery import registry_for

    app = Celery("runcell-django-test", set_as_current=False)
    registry = registry_for(app)
    assert registry.names() == ["claude"]
    assert registry.settings_path == "RUNCELL"
    assert registry.database_dsn == conf.resolve_database("default")
