"""Which ``runcell_*`` header values a worker accepts, without a broker.

The worker tests (``test_run_headers.py``) show a malformed header failing a real task;
these pin the rule itself for every shape at once: what a sender writes is accepted,
anything else names the header and the value, and keys a newer sender adds are ignored.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest

from runcell_celery import ConcurrencyConfigError
from runcell_celery.celery import headers
from runcell_celery.errors import ConcurrencyHeaderError


def _request(**message_headers: Any) -> SimpleNamespace:
    return SimpleNamespace(headers=message_headers, id="t-1", root_id="r-1", parent_id="p-1")


@pytest.mark.parametrize(
    ("header", "value"),
    [
        ("runcell_deadline", "1700000000"),
        ("runcell_deadline", math.nan),
        ("runcell_deadline", -math.inf),
        ("runcell_deadline", False),
        ("runcell_deadline", {"at": 1}),
        ("runcell_parent", ["llm"]),
        ("runcell_parent", {"limiter": ""}),
        ("runcell_parent", {"workload": 3}),
        ("runcell_parent", {"name": b"x"}),
        ("runcell_parent", {"deadline": math.nan}),
        ("runcell_parent", {"deadline": True}),
        ("runcell_select", ["interactive"]),
        ("runcell_select", {"workload": ""}),
        ("runcell_select", {"timeout_ms": 0}),
        ("runcell_select", {"timeout_ms": math.inf}),
        ("runcell_select", {"timeout_ms": "60000"}),
        ("runcell_admission", ""),
        ("runcell_publication", 7),
    ],
)
def test_a_value_no_sender_writes_is_refused_naming_the_header_and_the_run(
    header: str, value: Any
) -> None:
    with pytest.raises(ConcurrencyHeaderError) as raised:
        headers.parse(_request(**{header: value}), task_name="t")
    error = raised.value
    assert isinstance(error, ConcurrencyConfigError)  # stops like bad configuration
    assert f"message header {header!r}" in error.message
    assert (error.run_id, error.root_run_id, error.parent_run_id) == ("t-1", "r-1", "p-1")


def test_a_huge_forged_value_is_shown_shortened() -> None:
    with pytest.raises(ConcurrencyHeaderError) as raised:
        headers.parse(_request(runcell_select="x" * 100_000), task_name="t")
    assert len(raised.value.message) < 400


def test_what_senders_write_is_read_and_keys_a_newer_sender_adds_are_ignored() -> None:
    carried = headers.parse(
        _request(
            runcell_parent={
                "limiter": "llm",
                "workload": "background",
                "deadline": 1_700_000_000,
                "name": "rc.parent",
                "remaining_ms": 5_000,  # a newer sender's key
            },
            runcell_select={"workload": "interactive", "timeout_ms": 60_000, "tag": "x"},
            runcell_deadline=1_700_000_000.5,
            runcell_admission="t-1/abc",
            runcell_publication="pub-1",
        ),
        task_name="t",
    )
    assert carried.parent == {
        "limiter": "llm",
        "workload": "background",
        "deadline": 1_700_000_000.0,
        "name": "rc.parent",
    }
    assert (carried.select.workload, carried.select.timeout_ms) == ("interactive", 60_000)
    assert carried.deadline == 1_700_000_000.5


def test_absent_and_null_headers_carry_nothing() -> None:
    carried = headers.parse(_request(runcell_parent={"limiter": None}), task_name="t")
    assert carried.parent == {"limiter": None, "workload": None, "deadline": None, "name": None}
    assert headers.parse(_request(), task_name="t") == headers.CarriedRun()
