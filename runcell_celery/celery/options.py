"""The ``concurrency={...}`` task option, parsed and validated once per task.

.. code-block:: python

    @app.task(base=RunCellTask, bind=True,
              concurrency={"limiter": "claude", "workload": "background",
                           "timeout_ms": 120_000, "admission": "defer", "hold": "slot"})

Validation runs when the task is bound to its app (decoration, or app finalisation
for lazily evaluated tasks), so an unknown limiter or workload fails at startup,
never when the first message arrives.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from ..config import check_duration_ms
from ..errors import ConcurrencyConfigError
from ..hints import did_you_mean
from ..ports import DEFAULT_DEFER_AFTER_MS

__all__ = ["DEFAULT_DEFER_AFTER_MS", "RunOverride", "TaskConcurrency"]

Admission = Literal["wait", "defer"]
Hold = Literal["slot", "task"]

#: No fixed admission wait: a deferrable run's first slot parks by the expected-wait
#: rule (``defer_after_ms``) unless the task sets ``admission_wait_ms``.
DEFAULT_ADMISSION_WAIT_MS: float | None = None

_TASK_KEYS = (
    "limiter",
    "workload",
    "timeout_ms",
    "admission",
    "hold",
    "admission_wait_ms",
    "defer_after_ms",
)
_OVERRIDE_KEYS = ("workload", "timeout_ms")


def _unknown(where: str, key: object, allowed: tuple[str, ...]) -> ConcurrencyConfigError:
    return ConcurrencyConfigError(
        f"{where}[{key!r}] is invalid: unknown option; {did_you_mean(key, allowed)}"
    )


def _positive_number(where: str, key: str, value: object, *, allow_zero: bool) -> float:
    return check_duration_ms(value, field=f"{where}[{key!r}]", allow_zero=allow_zero)


def _choice(where: str, key: str, value: object, choices: tuple[str, ...]) -> Any:
    if value not in choices:
        raise ConcurrencyConfigError(
            f"{where}[{key!r}] = {value!r} is invalid: must be one of "
            + ", ".join(repr(c) for c in choices)
        )
    return value


def _name(where: str, key: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise ConcurrencyConfigError(
            f"{where}[{key!r}] = {value!r} is invalid: must be a non-empty string"
        )
    return value


@dataclass(frozen=True, slots=True)
class TaskConcurrency:
    """A task's declared concurrency settings.

    :param limiter: the registry name of the limiter; ``None`` inherits the parent
        run's limiter (a task sent from inside a limited task).
    :param workload: the task's *default* workload: a parent's workload wins over it,
        a per-call override wins over both.
    :param timeout_ms: the run's total budget, counted from its first start.
    :param admission: ``"wait"`` blocks the worker until a slot is free (or the
        deadline passes); ``"defer"`` parks the run when its first slot finds no room.
    :param hold: ``"slot"``: the body takes slots with ``slot()``; ``"task"``: the
        whole body runs inside one slot.
    :param admission_wait_ms: with ``"defer"``, a fixed wait for the first slot
        before the run is parked, replacing the rule below (``None``: the rule).
    :param defer_after_ms: with ``"defer"``, the rule's threshold: the run parks at
        once when its first slot's expected wait ((place in line) x (mean hold) /
        (workload's slots)) exceeds it, and otherwise waits up to it, then parks; so
        a worker process is blocked at most this long.
    """

    limiter: str | None = None
    workload: str | None = None
    timeout_ms: float | None = None
    admission: Admission = "wait"
    hold: Hold = "slot"
    admission_wait_ms: float | None = DEFAULT_ADMISSION_WAIT_MS
    defer_after_ms: float = DEFAULT_DEFER_AFTER_MS

    @classmethod
    def parse(cls, options: object, *, task_name: str) -> TaskConcurrency:
        """Parse a task's ``concurrency`` option; errors name the task and the key."""
        where = f"task {task_name!r} concurrency"
        if not isinstance(options, Mapping):
            raise ConcurrencyConfigError(f"{where} = {options!r} is invalid: must be a dict")
        for key in options:
            if key not in _TASK_KEYS:
                raise _unknown(where, key, _TASK_KEYS)
        limiter = options.get("limiter")
        workload = options.get("workload")
        timeout_ms = options.get("timeout_ms")
        admission_wait_ms = options.get("admission_wait_ms")
        if admission_wait_ms is not None and "defer_after_ms" in options:
            raise ConcurrencyConfigError(
                f"{where}['defer_after_ms'] is invalid beside 'admission_wait_ms': a fixed "
                "admission wait replaces the expected-wait rule; set one of the two"
            )
        spec = cls(
            limiter=None if limiter is None else _name(where, "limiter", limiter),
            workload=None if workload is None else _name(where, "workload", workload),
            timeout_ms=None
            if timeout_ms is None
            else _positive_number(where, "timeout_ms", timeout_ms, allow_zero=False),
            admission=_choice(
                where, "admission", options.get("admission", "wait"), ("wait", "defer")
            ),
            hold=_choice(where, "hold", options.get("hold", "slot"), ("slot", "task")),
            admission_wait_ms=None
            if admission_wait_ms is None
            else _positive_number(where, "admission_wait_ms", admission_wait_ms, allow_zero=True),
            defer_after_ms=_positive_number(
                where,
                "defer_after_ms",
                options.get("defer_after_ms", DEFAULT_DEFER_AFTER_MS),
                allow_zero=True,
            ),
        )
        if spec.workload is not None and spec.limiter is None:
            raise ConcurrencyConfigError(
                f"{where}['workload'] = {spec.workload!r} is invalid: a workload needs a "
                "'limiter' to belong to"
            )
        return spec


@dataclass(frozen=True, slots=True)
class RunOverride:
    """What one call selects: ``apply_async(..., concurrency={"workload": ...})``.

    A selected workload always wins (over the task's and the parent's); a timeout
    replaces the task's ``timeout_ms`` for this run.
    """

    workload: str | None = None
    timeout_ms: float | None = None

    @classmethod
    def parse(cls, options: object, *, task_name: str) -> RunOverride:
        where = f"{task_name}.apply_async(concurrency=...)"
        if not isinstance(options, Mapping):
            raise ConcurrencyConfigError(f"{where} = {options!r} is invalid: must be a dict")
        for key in options:
            if key not in _OVERRIDE_KEYS:
                raise _unknown(where, key, _OVERRIDE_KEYS)
        workload = options.get("workload")
        timeout_ms = options.get("timeout_ms")
        return cls(
            workload=None if workload is None else _name(where, "workload", workload),
            timeout_ms=None
            if timeout_ms is None
            else _positive_number(where, "timeout_ms", timeout_ms, allow_zero=False),
        )

    def to_header(self) -> dict[str, Any]:
        chosen = {"workload": self.workload, "timeout_ms": self.timeout_ms}
        return {key: value for key, value in chosen.items() if value is not None}
