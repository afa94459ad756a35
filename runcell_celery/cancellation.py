"""Cancellation tokens: a ``threading.Event`` that also calls back when it is set.

Waiting requests, held slots and child runs must react the moment a run is cancelled,
not poll; being an ``Event``, a token goes wherever events already do.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
from collections.abc import Callable

__all__ = ["CancellationToken"]

logger = logging.getLogger("runcell_celery.cancellation")

Callback = Callable[[], None]


class CancellationToken(threading.Event):
    """An event that cancels a run, and is cancelled with any of ``parents`` (so
    cancelling the root reaches every child run)."""

    def __init__(self, *parents: CancellationToken) -> None:
        super().__init__()
        self.reason: str | None = None
        self._callbacks: dict[int, Callback] = {}
        self._keys = itertools.count()
        self._guard = threading.Lock()
        self._unlink: list[Callback] = []
        for parent in parents:
            self._unlink.append(parent.add_callback(functools.partial(self._follow, parent)))

    def _follow(self, parent: CancellationToken) -> None:
        self.cancel(parent.reason)

    def cancel(self, reason: str | None = None) -> None:
        """Cancel: wake every waiter and run every callback once."""
        with self._guard:
            if self.is_set():
                return
            self.reason = reason or "cancelled"
            super().set()
            callbacks = list(self._callbacks.values())
            self._callbacks.clear()
        for callback in callbacks:
            try:
                callback()
            except Exception:  # a callback must not stop the others
                logger.exception("cancellation callback %r failed", callback)

    def set(self) -> None:  # so the token stands in for an Event
        self.cancel()

    def clear(self) -> None:  # a cancelled run stays cancelled
        raise RuntimeError("a CancellationToken cannot be un-cancelled; create a new one")

    def add_callback(self, callback: Callback) -> Callback:
        """Call ``callback`` on cancellation (at once if cancelled); return its remover."""
        with self._guard:
            if not self.is_set():
                self._callbacks[key := next(self._keys)] = callback
                return lambda: self._remove(key)
        callback()
        return lambda: None

    def _remove(self, key: int) -> None:
        with self._guard:
            self._callbacks.pop(key, None)

    def detach(self) -> None:
        """Stop listening to the parents (when the run that owns this token ends)."""
        for unlink in self._unlink:
            unlink()
        self._unlink.clear()
