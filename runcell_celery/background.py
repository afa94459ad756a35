"""Background threads, the fork policy, and the one owner of per-process state.

Every maintenance thread is a :class:`BackgroundLoop`: a named daemon thread holding
its owner weakly (a dropped owner ends it), logging instead of dying when a step raises.
Threads do not survive ``fork`` and a child must never use or close its parent's
sockets, so state made per process lives in a :class:`ProcessLocal`. Every piece of
state the library keeps for the whole process (event listeners, the fallback keeper,
PostgreSQL engines, Celery app states, caches, flags) is held by
:data:`DEFAULT_REGISTRY`, the only module-level mutable object of the package.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

__all__ = ["DEFAULT_REGISTRY", "BackgroundLoop", "ProcessLocal", "ProcessRegistry"]

logger = logging.getLogger("runcell_celery.background")

T = TypeVar("T")
O = TypeVar("O")  # noqa: E741 - the owner of a loop

#: A step returns how long to wait before the next one (seconds), or ``None`` to stop.
Step = Callable[[O], float | None]


class BackgroundLoop(Generic[O]):
    """Call ``step(owner)`` in a named daemon thread, ``owner`` held weakly, waiting the
    seconds it returns (``None``: stop; after a step raised, ``retry_s``)."""

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
    def stopping(self) -> threading.Event:  # steps may wait on it instead of sleeping
        return self._stop

    def start(self) -> None:
        """Start the thread unless it runs in this process (after ``fork``: the child's)."""
        pid = os.getpid()
        with self._lock:
            if self._thread is not None and self._pid == pid and not self._stop.is_set():
                return
            self._stop = threading.Event()
            self._pid = pid
            self._thread = threading.Thread(target=_run, args=(self,), name=self.name, daemon=True)
            self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """End the loop after its current step; wait up to ``timeout`` for it."""
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
    """One ``T`` per process, made by ``factory`` on first use in each; a parent's is
    kept alive in a forked child but never used or closed there."""

    def __init__(self, factory: Callable[[], T]) -> None:
        self._factory = factory
        self._pid: int | None = None
        self._value: T | None = None
        self._inherited: list[T] = []
        self._lock = threading.Lock()
        DEFAULT_REGISTRY._process_locals.add(self)

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
        """This process's instance if it was made (makes nothing)."""
        return self._value if self._pid == os.getpid() else None

    def discard(self) -> T | None:
        """Forget this process's instance and return it for the caller to close."""
        with self._lock:
            if self._value is None or self._pid != os.getpid():
                return None
            value, self._value, self._pid = self._value, None, None
            return value


class ProcessRegistry:
    """The owner of the library's per-process state, by name (``"module.what"``).

    :meth:`shared` and :meth:`value` are kept by a forked child, as module globals
    were; :meth:`local` is made anew in each process (:class:`ProcessLocal`); the
    locks of :meth:`lock` are made anew in a child (a parent's thread may have held
    one at the moment of fork).
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()  # a factory may ask for another entry
        self._shared: dict[str, Any] = {}
        self._values: dict[str, Any] = {}
        self._locals: dict[str, ProcessLocal[Any]] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._process_locals: weakref.WeakSet[ProcessLocal[Any]] = weakref.WeakSet()

    def shared(self, name: str, factory: Callable[[], T]) -> T:
        """The object called ``name``, made by ``factory`` on first use."""
        found = self._shared.get(name)
        if found is None:
            with self._lock:
                found = self._shared.get(name)
                if found is None:
                    found = self._shared[name] = factory()
        return found

    def local(self, name: str, factory: Callable[[], T]) -> T:
        """This process's object called ``name``, made by ``factory`` in each process."""
        found = self._locals.get(name)
        if found is None:
            with self._lock:
                found = self._locals.setdefault(name, ProcessLocal(factory))
        return found.get()  # type: ignore[no-any-return]

    def lock(self, name: str) -> threading.Lock:
        found = self._locks.get(name)
        if found is None:
            with self._lock:
                found = self._locks.setdefault(name, threading.Lock())
        return found

    def value(self, name: str, default: T) -> T:
        """The immutable value last :meth:`put` under ``name``, else ``default``."""
        return self._values.get(name, default)  # type: ignore[no-any-return]

    def put(self, name: str, value: object) -> None:
        self._values[name] = value  # one store: readers never see half a value

    def _after_fork_in_child(self) -> None:
        self._lock = threading.RLock()
        self._locks = {}
        for instance in list(self._process_locals):
            instance._lock = threading.Lock()


#: The one owner of per-process state (see :class:`ProcessRegistry`).
DEFAULT_REGISTRY = ProcessRegistry()
os.register_at_fork(after_in_child=DEFAULT_REGISTRY._after_fork_in_child)
