"""Message headers that carry a run between processes (never a global variable).

* ``runcell_parent`` — on every message sent from inside a run: the parent's limiter
  (and all its ``limiters`` and ``key`` over several), workload, deadline (Unix time,
  sender's clock) and name, inherited as the spec's nested runs are.
* ``runcell_select`` — what one call selected (``apply_async(concurrency=...)``).
* ``runcell_deadline`` — a deadline a re-publication carries when nothing else can
  tell the next delivery its budget.
* ``runcell_admission`` / ``runcell_publication`` — the request id a parked delivery
  asked with, and which re-publication this is (only that one takes the grant).
* ``runcell_key`` — the run's key, formed when sent; re-checked on delivery.

**Headers only shorten a budget**: anyone who can publish can write them, and another
host's clock is off by its error. :func:`parse` validates every header before a run
starts; unknown keys in a header dict are ignored, so a fleet can be upgraded gradually.
"""

from __future__ import annotations

import math
import reprlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypedDict

from ..config import check_duration_ms
from ..errors import ConcurrencyConfigError, ConcurrencyHeaderError
from ..keys import check_fair_key, check_key
from .options import RunOverride

__all__ = [
    "ADMISSION",
    "DEADLINE",
    "KEY",
    "PARENT",
    "PUBLICATION",
    "SELECT",
    "CarriedRun",
    "ParentHeader",
    "parse",
    "read",
]

PARENT = "runcell_parent"
SELECT = "runcell_select"
DEADLINE = "runcell_deadline"
ADMISSION = "runcell_admission"
PUBLICATION = "runcell_publication"
KEY = "runcell_key"


#: A forged header can be megabytes; an error message shows this much of it.
def _shown(value: object) -> str:
    shown = reprlib.Repr()
    shown.maxstring = shown.maxother = 80
    shown.maxdict = shown.maxlist = 6
    return shown.repr(value)


class ParentHeader(TypedDict, total=False):
    limiter: str | None
    workload: str | None
    deadline: float | None
    name: str | None
    limiters: list[str] | None  # of a parent over several (``limiter`` is the first)
    key: str | None


@dataclass(frozen=True, slots=True)
class CarriedRun:
    """What one message's headers say about its run, validated."""

    parent: ParentHeader | None = None
    select: RunOverride = field(default_factory=RunOverride)
    deadline: float | None = None
    key: str | None = None


def read(request: Any, name: str) -> Any:
    """Return a runcell header from a Celery request (``None`` when absent), unchecked."""
    value = (getattr(request, "headers", None) or {}).get(name)
    if value is None and hasattr(request, "get"):
        value = request.get(name)
    return value


def parse(request: Any, *, task_name: str, keyed: tuple[str, ...] = ()) -> CarriedRun:
    """Read and validate the run headers of a delivery (``runcell_key`` must be a key
    of each ``keyed`` limiter); errors name the task, header and value."""
    lineage = {
        "run_id": getattr(request, "id", None),
        "root_run_id": getattr(request, "root_id", None),
        "parent_run_id": getattr(request, "parent_id", None),
    }

    def invalid(header: str, value: object, rule: str) -> ConcurrencyHeaderError:
        return ConcurrencyHeaderError(
            f"task {task_name!r}: message header {header!r} = {_shown(value)} is invalid: {rule}",
            **lineage,
        )

    for name in (ADMISSION, PUBLICATION):
        value = read(request, name)
        if value is not None and (not isinstance(value, str) or not value):
            raise invalid(name, value, "must be a non-empty string")

    deadline = read(request, DEADLINE)
    if deadline is not None and not _is_time(deadline):
        raise invalid(DEADLINE, deadline, "must be a finite Unix time in seconds (a number)")

    parent = read(request, PARENT)
    if parent is not None:
        parent = _parent(parent, lambda rule: invalid(PARENT, parent, rule))

    select = read(request, SELECT)
    override = RunOverride()
    if select is not None:
        if not isinstance(select, Mapping):
            raise invalid(SELECT, select, "must be a dict with 'workload' and/or 'timeout_ms'")
        workload = select.get("workload")
        if workload is not None and (not isinstance(workload, str) or not workload):
            rule = f"its 'workload' = {_shown(workload)} must be a non-empty string"
            raise invalid(SELECT, select, rule)
        timeout_ms = select.get("timeout_ms")
        if timeout_ms is not None:
            try:
                timeout_ms = check_duration_ms(timeout_ms, field="its 'timeout_ms'")
            except ConcurrencyConfigError as exc:
                raise invalid(SELECT, select, exc.message) from None
        override = RunOverride(workload=workload, timeout_ms=timeout_ms)

    key = read(request, KEY)
    if key is not None:
        try:
            check_fair_key(key, argument="the key")
            for limiter in keyed:
                check_key(limiter, key)
        except ConcurrencyConfigError as exc:
            raise ConcurrencyHeaderError(
                f"task {task_name!r}: message header {KEY!r} is invalid: {exc.message}", **lineage
            ) from None
    return CarriedRun(parent=parent, select=override, deadline=deadline, key=key)


def _is_time(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)


def _parent(value: object, invalid: Callable[[str], ConcurrencyHeaderError]) -> ParentHeader:
    if not isinstance(value, Mapping):
        raise invalid("must be a dict with 'limiter', 'workload', 'deadline' and 'name'")

    def name(key: str) -> str | None:
        item = value.get(key)
        if item is not None and (not isinstance(item, str) or not item):
            raise invalid(f"its {key!r} = {_shown(item)} must be a non-empty string or null")
        return item

    deadline = value.get("deadline")
    if deadline is not None and not _is_time(deadline):
        raise invalid(
            f"its 'deadline' = {_shown(deadline)} must be a finite Unix time in seconds or null"
        )
    limiters = value.get("limiters")
    if limiters is not None and (
        not isinstance(limiters, list)
        or not limiters
        or not all(isinstance(item, str) and item for item in limiters)
    ):
        raise invalid(
            f"its 'limiters' = {_shown(limiters)} must be a non-empty list of limiter names or null"
        )
    parent = ParentHeader(
        limiter=name("limiter"),
        workload=name("workload"),
        deadline=None if deadline is None else float(deadline),
        name=name("name"),
    )
    if limiters is not None:
        parent["limiters"] = list(limiters)
    key = value.get("key")
    if key is not None:
        try:
            parent["key"] = check_fair_key(key, argument="its 'key'")
        except ConcurrencyConfigError as exc:
            raise invalid(exc.message) from None
    return parent
