"""Limits that conflict with the stored ones: refused at worker start, reported once after.

Every worker sharing a limiter must grant by the same limits. Under
``on_conflict="error"`` a worker whose settings differ would fail every task, so
:func:`refuse_conflicting_limits` checks them when the worker starts and, on a
definite conflict, logs one CRITICAL message and exits with status 78 (``EX_CONFIG``);
an unreachable database only warns. A conflict met later (another worker replaced the
limits) fails the task with a ``config-error`` event and is logged once per limiter
and change (:class:`SaidOnce`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from celery import Celery

from ..background import DEFAULT_REGISTRY
from ..errors import ConcurrencyConfigError, ConcurrencyError
from ..ports import LimitsConflict, StoredLimitsCheck
from .state import state_for

__all__ = [
    "EX_CONFIG",
    "SaidOnce",
    "WorkerRefused",
    "log_start_conflict",
    "refuse_conflicting_limits",
]

logger = logging.getLogger("runcell_celery.celery")

#: ``sysexits.h``'s configuration error (systemd: ``RestartPreventExitStatus=78``).
EX_CONFIG = 78


class WorkerRefused(SystemExit):
    """The worker refuses to start (exit status :data:`EX_CONFIG`): its limits
    conflict with the stored ones (``conflicts``), or its pool is one the library
    cannot run on (:mod:`.pools`); ``message`` is what was logged."""

    def __init__(self, message: str, conflicts: Sequence[LimitsConflict] = ()) -> None:
        super().__init__(EX_CONFIG)
        self.message = message
        self.conflicts = tuple(conflicts)

    def __str__(self) -> str:
        return self.message


def refuse_conflicting_limits(app: Celery) -> None:
    """Raise :class:`WorkerRefused` (after one CRITICAL line) when a configured
    limiter is stored with other limits and its backend would refuse it."""
    registry = state_for(app).registry
    configs = registry.configured()
    if not configs:
        return
    try:
        backend: object = registry.backend  # a Backend that may also check limits
        if not isinstance(backend, StoredLimitsCheck):
            return
        conflicts = backend.limit_conflicts(configs)
    except ConcurrencyError as exc:
        logger.warning(
            "runcell: could not compare this worker's limits with the stored ones at "
            "start (%s); each limiter is checked when first used",
            exc.message,
        )
        return
    if conflicts:
        details = "; ".join(
            f"limiter {conflict.limiter!r} is stored with different limits: {conflict.differences}"
            for conflict in conflicts
        )
        option = f'{registry.settings_path}["POSTGRES"]["on_conflict"]'
        message = (
            f"runcell: this worker refuses to start: {details}. Every worker sharing a "
            f'limiter grants by the stored limits, and with {option} = "error" this one would '
            "fail every task it took, so it takes none. To fix it, either stop every worker, "
            "change the settings and start them again; or, to change limits while the fleet "
            f'runs, set {option} = "use_stored" on every worker, store the new limits with '
            "`manage.py runcell_sync_limiters --replace` (without Django: `celery -A <app> "
            "runcell sync-limiters --replace`) and restart the workers with the new settings; or "
            "correct this worker's settings if they are a mistake (docs/postgres.md: \"Changing "
            f'limits on a running fleet"). Exit status {EX_CONFIG}.'
        )
        logger.critical("%s", message)
        raise WorkerRefused(message, conflicts)


class SaidOnce:
    """What a process already said about each limiter: one line per limiter and change."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._said: dict[str, str] = {}

    def first(self, limiter: str, message: str) -> bool:
        with self._lock:
            if self._said.get(limiter) == message:
                return False
            self._said[limiter] = message
            return True

    def forget(self, limiter: str) -> None:
        """The limiter is fine again: a later conflict is said again."""
        with self._lock:
            self._said.pop(limiter, None)


def log_start_conflict(error: ConcurrencyError, task_name: str) -> None:
    """Log, once per limiter and change, a run that failed before its first slot with
    a configuration error naming a limiter (its ``config-error`` event is the task's)."""
    if not isinstance(error, ConcurrencyConfigError) or error.limiter is None:
        return
    started = DEFAULT_REGISTRY.shared("celery.conflicts.started", SaidOnce)
    if started.first(error.limiter, error.message):
        logger.error(
            "runcell: task %r cannot run: %s (said once per limiter and change; every "
            "such task fails with a config-error event)",
            task_name,
            error.message,
        )
