"""Limits that conflict with the stored ones: refused at worker start, reported once after.

Every worker sharing a limiter must grant by the same limits, so the first one stores
them and the others are checked against them (``RUNCELL["POSTGRES"]["on_conflict"]``).
Under ``"error"`` (the default) a worker whose settings differ would fail every task it
took, so :func:`refuse_conflicting_limits` checks every configured limiter when the
worker starts, in its main process and before its pool forks or its consumer takes a
message (the :class:`~.bootsteps.RunCellStep` calls it while the worker's blueprint is
built): on a conflict it logs one CRITICAL message naming each limiter, the differing
fields (stored and given) and what to do, and ends the ``celery worker`` with exit
status 78 (``EX_CONFIG``). The rest of the fleet serves on.

Only a definite conflict refuses: a database that cannot be reached at start is left
to the task's own retries (a warning says the check was skipped), and ``"replace"`` or
``"use_stored"`` never refuse.

A conflict can still reach a running worker: another worker replaced the limits after
this one started (or the check was skipped). A task that then cannot create its
limiter fails with :class:`~runcell_celery.errors.ConcurrencyConfigError` and a
``config-error`` event (emitted by the task); the worker logs it once per
limiter and change, and its sweeper too (:class:`SaidOnce`), not at every task or tick.
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
    "refusal_message",
    "refuse_conflicting_limits",
]

logger = logging.getLogger("runcell_celery.celery")

#: The exit status of a worker that refuses to start (``sysexits.h``: configuration
#: error). A supervisor can be told not to restart on it (systemd:
#: ``RestartPreventExitStatus=78``).
EX_CONFIG = 78


class WorkerRefused(SystemExit):
    """The worker refuses to start: its limits conflict with the stored ones.

    A :class:`SystemExit` with status :data:`EX_CONFIG`, so ``celery worker`` exits
    with it; ``message`` is what was logged.
    """

    def __init__(self, message: str, conflicts: Sequence[LimitsConflict]) -> None:
        super().__init__(EX_CONFIG)
        self.message = message
        self.conflicts = tuple(conflicts)

    def __str__(self) -> str:
        return self.message


def refusal_message(conflicts: Sequence[LimitsConflict], settings_path: str) -> str:
    """The one message a refusing worker logs: each limiter and field, and what to do."""
    details = "; ".join(
        f"limiter {conflict.limiter!r} is stored with different limits: {conflict.differences}"
        for conflict in conflicts
    )
    option = f'{settings_path}["POSTGRES"]["on_conflict"]'
    return (
        f"runcell: this worker refuses to start: {details}. Every worker sharing a "
        f'limiter grants by the stored limits, and with {option} = "error" this one would '
        "fail every task it took, so it takes none. To fix it, either stop every worker, "
        "change the settings and start them again; or, to change limits while the fleet "
        f'runs, set {option} = "use_stored" on every worker, store the new limits with '
        "`manage.py runcell_sync_limiters --replace` (without Django: a limiter created "
        "with on_conflict='replace') and restart the workers with the new settings; or "
        "correct this worker's settings if they are a mistake (README: \"Changing limits "
        f'on a running fleet"). Exit status {EX_CONFIG}.'
    )


def refuse_conflicting_limits(app: Celery) -> None:
    """Refuse to start a worker whose configured limits conflict with the stored ones.

    :raises WorkerRefused: a limiter is stored with other limits and its backend would
        refuse it (``on_conflict="error"``), after logging one CRITICAL message.
    """
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
        message = refusal_message(conflicts, registry.settings_path)
        logger.critical("%s", message)
        raise WorkerRefused(message, conflicts)


class SaidOnce:
    """What a process already said about each limiter: one line per limiter and change
    (a message that differs is a change), not one per task or per sweeper tick."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._said: dict[str, str] = {}

    def first(self, limiter: str, message: str) -> bool:
        """Whether ``message`` is new for ``limiter`` (then it counts as said)."""
        with self._lock:
            if self._said.get(limiter) == message:
                return False
            self._said[limiter] = message
            return True

    def forget(self, limiter: str) -> None:
        """The limiter is fine again: a later conflict is said again."""
        with self._lock:
            self._said.pop(limiter, None)


def _started() -> SaidOnce:
    return DEFAULT_REGISTRY.shared("celery.conflicts.started", SaidOnce)


def log_start_conflict(error: ConcurrencyError, task_name: str) -> None:
    """Log, once per limiter and change, a delivery whose run failed before asking for
    a slot with a configuration error naming a limiter (typically: its limiter could
    not be created, the stored limits having changed since the worker started).

    The delivery's ``config-error`` event is the task's to emit, as for every failure
    before a slot (:func:`runcell_celery.request.report_failure`); this only keeps the
    log to one line per change however many tasks meet it.
    """
    if not isinstance(error, ConcurrencyConfigError) or error.limiter is None:
        return
    if _started().first(error.limiter, error.message):
        logger.error(
            "runcell: task %r cannot run: %s (said once per limiter and change; every "
            "such task fails with a config-error event)",
            task_name,
            error.message,
        )
