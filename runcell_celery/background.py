"""Background threads and the fork policy: one way to run a loop, one way to survive fork.

**Loops.** Every maintenance thread the library runs (lease keeper, grant listener,
parked-task sweeper, counter flusher, revocation watcher and publisher, the Django
event recorder) is a :class:`BackgroundLoop`: a named daemon thread that holds only a
weak reference to its owner (so a dropped owner lets the thread end), calls one step
function, logs instead of dying when a step raises, and stops cleanly.

**Fork.** Celery's prefork pool forks children from a parent that may already hold
connections and threads. Threads do not survive ``fork`` and a socket inherited from
the parent must never be used or closed by the child. The policy is the same
everywhere: per-process state lives in a :class:`ProcessLocal`, which hands each
process its own instance, made lazily on first use; the parent's instance is kept
alive in the child (never closed, never used), so nothing of the parent's is touched.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

__all__ = ["BackgroundLoop", "ProcessLocal"]

logger = logging.getLogger("runcell_celery.background")

T = TypeVar("T")
O = TypeVar("O")  # noqa: E741 - the owner of a loop

#: A step returns how long to wait before the next one (seconds), or ``None`` to stop.
Step = Callable[[O], float | None]


class BackgroundLoop(Generic[O]):
    """Call ``step(owner)`` again and again in a named daemon thread.

    :param name: the thread's name (``runcell-...``), shown in thread dumps.
    :param owner: held weakly; the loop ends once it is garbage collected.
    :param step: does one round of work and returns the seconds to wait before the
        next (``0``: at once; ``None``: stop). A step that blocks on its own (the
        keeper's condition wait, the listener's ``notifies``) returns ``0``.
    :param retry_s: how long to wait after a step raised (it is logged, then retried).
    """

    def __init__(self, name: str, owner: O, step: Step[O], *, retry_s: float = 1.0) -> None:
        self.name = name
        self._owner = weakref.ref(owner)
        self._step = step
        self._retry_s = retry_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pid: int | None = None
        self._lock = threading.Lock()

    @property
    def stopping(self) -> threading.Event:
        """Set once :meth:`stop` was called (steps may wait on it instead of sleeping)."""
        return self._stop

    def start(self) -> None:
        """Start the thread in this process, unless it already runs here.

        After ``fork`` the parent's thread does not exist in the child: calling
        ``start`` there starts the child's own.
        """
        pid = os.getpid()
        with self._lock:
            if self._thread is not None and self._pid == pid and not self._stop.is_set():
                return
            self._stop = threading.Event()
            self._pid = pid
            self._thread = threading.Thread(target=_run, args=(self,), name=self.name, daemon=True)
            self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Ask the loop to end after its current step; wait up to ``timeout`` for it."""
        self._stop.set()
        thread = self._thread
        if timeout is not None and thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    @property
    def running(self) -> bool:
        thread = self._thread
        return thread is not None and thread.is_alive() and self._pid == os.getpid()


def _run(loop: BackgroundLoop[object]) -> None:
    stop = loop._stop
    while not stop.is_set():
        owner = loop._owner()
        if owner is None:
            return
        try:
            pause = loop._step(owner)
        except Exception:  # never die: the library's guarantees depend on these loops
            logger.exception("%s: a step failed; retrying in %.1fs", loop.name, loop._retry_s)
            pause = loop._retry_s
        del owner
        if pause is None:
            return
        if pause > 0 and stop.wait(pause):
            return


class ProcessLocal(Generic[T]):
    """One ``T`` per process, made by ``factory`` on first use in each process.

    What a parent process made is kept alive in a forked child but never returned
    there, so the child never uses or closes the parent's sockets and threads.
    """

    def __init__(self, factory: Callable[[], T]) -> None:
        self._factory = factory
        self._pid: int | None = None
        self._value: T | None = None
        self._inherited: list[T] = []
        self._lock = threading.Lock()
        _instances.add(self)

    def get(self) -> T:
        pid = os.getpid()
        value = self._value
        if value is not None and self._pid == pid:
            return value
        with self._lock:
            if self._value is None or self._pid != pid:
                if self._value is not None:
                    self._inherited.append(self._value)
                self._value = self._factory()
                self._pid = pid
            return self._value

    def peek(self) -> T | None:
        """This process's instance if it was made, else ``None`` (makes nothing)."""
        return self._value if self._pid == os.getpid() else None

    def discard(self) -> T | None:
        """Forget this process's instance and return it (the caller closes it); the
        next :meth:`get` makes a new one. ``None`` when none was made here."""
        with self._lock:
            if self._value is None or self._pid != os.getpid():
                return None
            value, self._value, self._pid = self._value, None, None
            return value

    def _after_fork_in_child(self) -> None:
        # The lock may have been held by a parent thread at the moment of fork.
        self._lock = threading.Lock()


_instances: weakref.WeakSet[ProcessLocal[Any]] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for instance in list(_instances):
        instance._after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)
