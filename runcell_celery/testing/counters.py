"""Read a Celery app's admission counters in a test.

The integration counts, per task name and limiter, deliveries, admission deferrals,
provider attempts, provider failures and concurrency failures
(:mod:`runcell_celery.celery.counters`). A test that runs its worker in its own
process (``celery_worker``) reads this process's counts: they are complete the
moment a task's result is in, with no database round trip, on either backend.
Needs the ``celery`` extra; Celery is imported when the counts are read.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from ..ports import AdmissionCount

if TYPE_CHECKING:
    from celery import Celery

__all__ = ["AdmissionCounts"]

#: The counts of a row (every field but the task name and the limiter).
_COUNTS = tuple(f.name for f in dataclasses.fields(AdmissionCount))[2:]


class AdmissionCounts:
    """The admission counts of ``app``'s tasks counted in this process."""

    def __init__(self, app: Celery) -> None:
        self.app = app

    def all(self) -> list[AdmissionCount]:
        """One row per task name and limiter label (``"openai+tenant"`` for a list)."""
        from ..celery.state import state_for

        return state_for(self.app).counters.local()

    def of(self, task_name: str, *, limiter: str | None = None) -> AdmissionCount:
        """``task_name``'s counts, added up over its limiters (or for ``limiter``).

        Zeros when nothing was counted: a task that never ran reads as such.
        """
        rows = [
            row
            for row in self.all()
            if row.task_name == task_name and (limiter is None or row.limiter == limiter)
        ]
        totals = {name: sum(getattr(row, name) for row in rows) for name in _COUNTS}
        label = limiter if limiter is not None else ", ".join(sorted({r.limiter for r in rows}))
        return AdmissionCount(task_name, label or "-", **totals)
