"""The arguments of ``slot()``, ``guard()`` and ``run()``, checked where they enter.

With the settings' rules, naming the argument and the value (``slot(max_hold_ms) = -1
is invalid: must be positive``): never a ``TypeError`` from deep inside, never a bad
value reaching a database. Cheap, as ``slot()`` runs them on every provider call.
"""

from __future__ import annotations

import math
import reprlib
from collections.abc import Sequence

from .cancellation import CancellationToken
from .config import MAX_NAME_LENGTH, check_duration_ms, text_problem
from .deadline import Deadline
from .errors import ConcurrencyConfigError
from .keys import check_fair_key
from .protocol import ConcurrencyLimiter, RunAdmission, supports

__all__ = [
    "MAX_ID_LENGTH",
    "check_admission",
    "check_cancel",
    "check_deadline",
    "check_deadline_at",
    "check_id",
    "check_limiter",
    "check_limiter_list",
    "check_slot_arguments",
    "check_text",
]

#: The longest request or run id: ids are indexed (at most 2,704 bytes an entry).
MAX_ID_LENGTH = 255


def _invalid(argument: str, value: object, rule: str) -> ConcurrencyConfigError:
    shown = reprlib.Repr()
    shown.maxstring = shown.maxother = 60
    return ConcurrencyConfigError(f"{argument} = {shown.repr(value)} is invalid: {rule}")


def check_limiter(value: object, *, argument: str) -> ConcurrencyLimiter:
    """Return ``value`` if it is a limiter (a :class:`ConcurrencyLimiter`)."""
    if not supports(value, ConcurrencyLimiter):
        raise _invalid(
            argument,
            value,
            f"must be a limiter (a ConcurrencyLimiter such as create_concurrency_limiter() "
            f"makes), not {type(value).__name__}; a limiter configured by name is "
            "registry.get(name)",
        )
    return value  # type: ignore[return-value]


def check_limiter_list(
    value: object, *, argument: str, items: str | None = None
) -> tuple[ConcurrencyLimiter, ...]:
    """A limiter, or a sequence of limiters, as a tuple (``None``: empty); a bad item is
    named by ``items`` formatted with its index (default ``argument[i]``)."""
    if value is None:
        return ()
    if (
        isinstance(value, Sequence)
        and not isinstance(value, str | bytes)
        and not supports(value, ConcurrencyLimiter)
    ):
        items = items or argument + "[{}]"
        return tuple(check_limiter(x, argument=items.format(i)) for i, x in enumerate(value))
    return (check_limiter(value, argument=argument),)


def check_text(value: object, *, argument: str, maximum: int = MAX_NAME_LENGTH) -> str:
    """Return ``value`` if it is a storable non-blank string of at most ``maximum``
    characters (a workload, a run's name)."""
    if (problem := text_problem(value, maximum)) is not None:
        raise _invalid(argument, value, problem)
    return str(value)


def check_id(value: object, *, argument: str) -> str:
    return check_text(value, argument=argument, maximum=MAX_ID_LENGTH)


def check_cancel(value: object, *, argument: str) -> CancellationToken:
    if not isinstance(value, CancellationToken):
        raise _invalid(argument, value, "must be a CancellationToken")
    return value


def check_deadline(value: object, *, argument: str) -> Deadline:
    if not isinstance(value, Deadline):
        raise _invalid(
            argument,
            value,
            "must be a Deadline (Deadline.after_ms(...)); for a Unix time use deadline_at",
        )
    return value


def check_deadline_at(value: object, *, argument: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _invalid(argument, value, "must be a finite Unix time in seconds (a number)")
    return float(value)


def check_admission(value: object, *, argument: str) -> RunAdmission:
    if not isinstance(value, RunAdmission):
        raise _invalid(argument, value, "must be an Admission")
    return value


def check_slot_arguments(
    call: str,
    limiters: Sequence[object],
    workload: object,
    key: object,
    max_hold_ms: object,
    cancel: object,
    request_id: object,
) -> None:
    """Check what ``slot()`` (or ``guard()``, named by ``call``) was given."""
    for i, limiter in enumerate(limiters):
        if limiter is not None:
            check_limiter(limiter, argument=f"{call}(limiters[{i}])")
    if workload is not None:
        check_text(workload, argument=f"{call}(workload)")
    if key is not None:
        check_fair_key(key, argument=f"{call}(key)")
    if max_hold_ms is not None:
        check_duration_ms(max_hold_ms, field=f"{call}(max_hold_ms)")
    if cancel is not None:
        check_cancel(cancel, argument=f"{call}(cancel)")
    if request_id is not None:
        check_id(request_id, argument=f"{call}(request_id)")
