"""Message headers that carry a run between processes.

A task message is the only thing a parent run and its child (on another worker,
another host) share, so everything a child inherits travels in headers, never in a
global variable:

* ``runcell_parent`` — set on every message sent from inside a run: the parent's
  limiter name, workload, deadline (Unix time on the sender's clock) and name, and for
  a run over several limiters all their names (``limiters``) and its key (``key``). The
  child inherits them as the spec's nested runs do.
* ``runcell_select`` — what one call selected (``apply_async(concurrency=...)``).
* ``runcell_deadline`` — a deadline (Unix time on the sender's clock) that a
  re-publication carries when nothing else can tell the next delivery its budget.
* ``runcell_admission`` — the request id a parked delivery asked with, carried by its
  re-publication so that it claims the grant made to that delivery.
* ``runcell_publication`` — which re-publication of a parked run this message is; only
  that publication may take the granted lease.
* ``runcell_key`` — the run's key (of its keyed limiters), formed from the task's
  arguments when it was sent (``concurrency={"key": ...}``); re-checked as a key on
  delivery. A message without it (sent by something else) has its key formed from the
  delivered arguments.

**Headers only shorten a budget.** Anyone who can publish to the broker can write
headers, and a Unix time read on another host is off by that host's clock error. So
a run's budget is a *duration* recorded in database time: with a backend that records
runs (:class:`~runcell_celery.ports.RunStore`) every delivery asks the store for the
milliseconds left since the run's first start. A deadline header is only a bound
taken together with it — the earlier wins — so a forged or skewed header can end a
run sooner, never later. A re-publication whose budget the store keeps writes no
``runcell_deadline`` at all, so no host's clock enters it.

:func:`parse` validates every header before a run starts: a value no sender writes
(wrong type, NaN, infinity, wrong shape) fails the delivery with
:class:`~runcell_celery.errors.ConcurrencyHeaderError` naming the header and the
value, and the task body does not run. Keys a newer sender adds to a header dict are
ignored, so a fleet can be upgraded one worker at a time.
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
    #: Every limiter of a parent over several (``limiter`` is the first).
    limiters: list[str] | None
    #: The parent's key (its fairness key over several limiters).
    key: str | None


@dataclass(frozen=True, slots=True)
class CarriedRun:
    """What one message's headers say about its run, validated.

    :param parent: the parent run, when the message was sent from inside one.
    :param select: what the sending call selected (empty when nothing).
    :param deadline: a bound on the run's deadline (Unix time, another host's clock).
    :param key: the run's key, formed when the message was sent (``None``: not sent).
    """

    parent: ParentHeader | None = None
    select: RunOverride = field(default_factory=RunOverride)
    deadline: float | None = None
    key: str | None = None


def read(request: Any, name: str) -> Any:
    """Return a runcell header from a Celery request (``None`` when absent), unchecked."""
    headers = getattr(request, "headers", None) or {}
    value = headers.get(name)
    if value is None:
        value = request.get(name) if hasattr(request, "get") else None
    return value


def parse(request: Any, *, task_name: str, keyed: tuple[str, ...] = ()) -> CarriedRun:
    """Read and validate the run headers of a delivery.

    :param keyed: the task's keyed limiters: ``runcell_key`` must be a valid key of each
        (:func:`runcell_celery.keys.check_key`).
    :raises ConcurrencyHeaderError: a header holds a value no sender writes; the
        message names the task, the header and the value, and carries the run's ids.
    """
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
            raise invalid(
                SELECT,
                select,
                f"its 'workload' = {_shown(workload)} must be a non-empty string",
            )
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
                f"task {task_name!r}: message header {KEY!r} is invalid: {exc.message}",
                **lineage,
            ) from None
    return CarriedRun(parent=parent, select=override, deadline=deadline, key=key)


def _is_time(value: object) -> bool:
    """A finite number that is not a bool (JSON carries ``true`` as a number in Python)."""
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
