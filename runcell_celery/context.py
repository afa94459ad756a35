"""Runs: the unit that owns a time budget, a cancellation and a place in a run tree.

A run (in Celery, one task execution) lives in a :mod:`contextvars` variable, so it
follows ``copy_context`` threads and asyncio tasks. A child inherits its parent's
limiters (unless it names different ones), key, workload (its own ``default_workload``
does not replace the parent's, so nesting cannot move work to another workload by
accident), cancellation, remaining budget and admission.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextvars import ContextVar, Token
from dataclasses import dataclass, field, replace
from types import TracebackType

from .arguments import (
    check_admission,
    check_cancel,
    check_deadline,
    check_deadline_at,
    check_id,
    check_limiter_list,
    check_text,
)
from .cancellation import CancellationToken
from .config import check_duration_ms
from .deadline import Deadline
from .errors import ConcurrencyConfigError
from .ids import new_run_id
from .keys import check_fair_key
from .protocol import (
    ConcurrencyLimiter,
    RunAdmission,
    RunLineage,
    SupportsValidateWorkload,
)
from .several import check_members, resolve_workloads

__all__ = ["RunContext", "RunOptions", "RunProgress", "current_run", "run"]


@dataclass(slots=True)
class RunProgress:
    """What a run has done so far, shared by its slots (the one mutable part)."""

    slots_taken: int = 0


@dataclass(frozen=True, slots=True)
class RunContext:
    """The run a piece of code belongs to (``limiter``: the first of ``limiters``)."""

    run_id: str
    root_run_id: str
    parent_run_id: str | None = None
    limiter: ConcurrencyLimiter | None = None
    workload: str | None = None
    deadline: Deadline | None = None
    cancel: CancellationToken | None = None
    name: str | None = None
    admission: RunAdmission | None = None
    limiters: tuple[ConcurrencyLimiter, ...] = ()
    key: str | None = None
    progress: RunProgress = field(default_factory=RunProgress, compare=False)
    lineage: RunLineage = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        lineage = RunLineage(self.run_id, self.root_run_id, self.parent_run_id)
        object.__setattr__(self, "lineage", lineage)
        if not self.limiters and self.limiter is not None:
            object.__setattr__(self, "limiters", (self.limiter,))
        elif self.limiters and self.limiter is not self.limiters[0]:
            object.__setattr__(self, "limiter", self.limiters[0])

    def remaining_ms(self) -> float | None:
        return None if self.deadline is None else self.deadline.remaining_ms()

    def deadline_timestamp(self) -> float | None:
        return None if self.deadline is None else self.deadline.to_unix()


_current: ContextVar[RunContext | None] = ContextVar("runcell_run", default=None)


def current_run() -> RunContext | None:
    return _current.get()


def _same(mine: tuple[ConcurrencyLimiter, ...], theirs: tuple[ConcurrencyLimiter, ...]) -> bool:
    return len(mine) == len(theirs) and all(a is b for a, b in zip(mine, theirs, strict=True))


@dataclass(frozen=True, slots=True)
class RunOptions:
    """What :class:`run` was asked for, before it meets its parent."""

    limiter: ConcurrencyLimiter | None = None
    workload: str | None = None
    default_workload: str | None = None
    timeout_ms: float | None = None
    deadline: Deadline | None = None
    cancel: CancellationToken | None = None
    run_id: str | None = None
    root_run_id: str | None = None
    parent_run_id: str | None = None
    name: str | None = None
    admission: RunAdmission | None = None
    limiters: tuple[ConcurrencyLimiter, ...] = ()
    key: str | None = None


def _check_arguments(options: RunOptions, deadline_at: float | None) -> None:
    """Check ``run()``'s other arguments; each error names the argument and the value."""
    checks: dict[str, Callable[..., object]] = {
        "workload": check_text,
        "default_workload": check_text,
        "deadline": check_deadline,
        "deadline_at": check_deadline_at,
        "cancel": check_cancel,
        "run_id": check_id,
        "root_run_id": check_id,
        "parent_run_id": check_id,
        "name": check_id,  # a task's name, as long as an id may be
        "admission": check_admission,
        "key": check_fair_key,
    }
    for argument in checks:
        value = deadline_at if argument == "deadline_at" else getattr(options, argument)
        if value is not None:
            checks[argument](value, argument=f"run({argument})")


class run:  # noqa: N801 - a context manager named like the thing it opens
    """Start a run (sync ``with`` or ``async with``); nested inside another, a child run.

    :param limiter: a limiter, or a sequence of limiters (each slot holds one in every
        one, granted together); a child without one uses its parent's.
    :param workload: the workload this run *selects* (always wins); ``default_workload``
        is used only when neither the run nor its parent selects one.
    :param timeout_ms: total budget from entering the run, slot waits included; the
        earliest of it, ``deadline``, ``deadline_at`` (Unix time) and the parent's wins.
    :param run_id: default: a new UUID; ``root_run_id`` and ``parent_run_id`` give the
        lineage when the parent is in another process.
    :param name: a label for the run, shown as the slot holder.
    :raises ConcurrencyConfigError: at once, before anything waits, naming the bad
        argument or workload, or limiters that cannot be held together.
    """

    def __init__(
        self,
        *,
        limiter: ConcurrencyLimiter | Sequence[ConcurrencyLimiter] | None = None,
        workload: str | None = None,
        default_workload: str | None = None,
        timeout_ms: float | None = None,
        deadline: Deadline | None = None,
        deadline_at: float | None = None,
        cancel: CancellationToken | None = None,
        run_id: str | None = None,
        root_run_id: str | None = None,
        parent_run_id: str | None = None,
        name: str | None = None,
        admission: RunAdmission | None = None,
        key: str | None = None,
    ) -> None:
        limiters = check_limiter_list(limiter, argument="run(limiter)", items="run(limiter[{}])")
        options = RunOptions(
            limiter=limiters[0] if limiters else None,
            limiters=limiters,
            key=key,
            workload=workload,
            default_workload=default_workload,
            timeout_ms=timeout_ms,
            deadline=deadline,
            cancel=cancel,
            run_id=run_id,
            root_run_id=root_run_id,
            parent_run_id=parent_run_id,
            name=name,
            admission=admission,
        )
        _check_arguments(options, deadline_at)
        if deadline_at is not None:
            deadline = Deadline.earliest(deadline, Deadline.from_unix(deadline_at))
        if timeout_ms is not None:
            timeout_ms = check_duration_ms(timeout_ms, field="run(timeout_ms)", allow_zero=True)
        self.options = replace(options, deadline=deadline, timeout_ms=timeout_ms)
        self._token: Token[RunContext | None] | None = None
        self._own_cancel: CancellationToken | None = None
        self.context: RunContext | None = None

    def _build(self) -> RunContext:
        o = self.options
        parent = _current.get()
        run_id = o.run_id or new_run_id()
        if o.parent_run_id is not None or parent is None:
            root, parent_id = o.root_run_id or run_id, o.parent_run_id
        else:
            root, parent_id = parent.root_run_id, parent.run_id
        limiters, workload = o.limiters, o.workload
        if parent and parent.limiters and (not limiters or _same(limiters, parent.limiters)):
            limiters, workload = parent.limiters, workload or parent.workload
        workload = workload or o.default_workload
        key = o.key if o.key is not None else (parent.key if parent is not None else None)
        lineage = {"run_id": run_id, "root_run_id": root, "parent_run_id": parent_id}
        if limiters:
            try:
                if len(limiters) == 1:
                    if isinstance(limiters[0], SupportsValidateWorkload):
                        workload = limiters[0].validate_workload(workload)
                else:
                    # Selected, not resolved: it applies where a limiter has it.
                    check_members(limiters)
                    resolve_workloads(limiters, workload)
            except ConcurrencyConfigError as exc:
                # Name the run that failed to start, as every ConcurrencyError does.
                raise ConcurrencyConfigError(
                    exc.message, limiter=limiters[0].name, workload=exc.workload, **lineage
                ) from None
        elif workload is not None:
            raise ConcurrencyConfigError(
                f"run selects workload {workload!r} but has no limiter",
                workload=workload,
                **lineage,
            )

        deadline = Deadline.earliest(
            parent.deadline if parent is not None else None,
            Deadline.after_ms(o.timeout_ms) if o.timeout_ms is not None else None,
            o.deadline,
        )
        cancel, inherited = o.cancel, parent.cancel if parent is not None else None
        if cancel is not None and inherited is not None:
            cancel = self._own_cancel = CancellationToken(cancel, inherited)
        return RunContext(
            run_id=run_id,
            root_run_id=root,
            parent_run_id=parent_id,
            limiter=limiters[0] if limiters else None,
            limiters=limiters,
            key=key,
            workload=workload,
            deadline=deadline,
            cancel=cancel or inherited,
            name=o.name or (parent.name if parent is not None else None),
            admission=o.admission or (parent.admission if parent is not None else None),
        )

    def __enter__(self) -> RunContext:
        context = self._build()
        self.context = context
        self._token = _current.set(context)
        return context

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._token is not None:
            _current.reset(self._token)
            self._token = None
        if self._own_cancel is not None:
            self._own_cancel.detach()
            self._own_cancel = None

    async def __aenter__(self) -> RunContext:
        return self.__enter__()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.__exit__(exc_type, exc, tb)
