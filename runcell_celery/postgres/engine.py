"""The engine: what a PostgreSQL backend's limiters share in one process.

One :class:`Engine` per backend and process holds the database (its pool), the waiting
room (listener, safety poll), the ``runcell-db`` executor, the lease keeper and the key
purgers; :meth:`Engine.close` ends every thread it started and closes every connection
it opened, like :meth:`psycopg_pool.ConnectionPool.close`.
"""

from __future__ import annotations

import os
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from ..background import DEFAULT_REGISTRY, BackgroundLoop
from ..errors import ConcurrencyLimiterError
from ..keeper import LeaseKeeper
from .connection import Database, redacted
from .options import PostgresOptions
from .waiting import WaitRoom

#: How long :meth:`Engine.close` waits for each of its threads to end (seconds).
CLOSE_TIMEOUT_S = 10.0


class Engine:
    """One backend's resources in this process; :meth:`close` ends them all."""

    def __init__(self, database: Database, options: PostgresOptions) -> None:
        self.database = database
        self.options = options
        #: Renews every lease its backend's limiters hold: one thread for all of them.
        self.keeper = LeaseKeeper()
        self._lock = threading.Lock()
        self._room: WaitRoom | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._loops: weakref.WeakSet[BackgroundLoop[Any]] = weakref.WeakSet()
        self._said: set[tuple[str, str]] = set()
        self.closed = False
        #: The process that made it (a forked child never uses nor closes it).
        self.pid = os.getpid()

    @property
    def room(self) -> WaitRoom:
        """The waiting room of every waiter of this engine (made on first use)."""
        room = self._room
        if room is None or self.closed:
            with self._lock:
                self._check_open()
                room = self._room = self._room or WaitRoom(self.database, self.options)
        return room

    @property
    def executor(self) -> ThreadPoolExecutor:
        """The ``runcell-db`` threads of async calls (as many as the pool's connections)."""
        executor = self._executor
        if executor is None or self.closed:
            with self._lock:
                self._check_open()
                executor = self._executor = self._executor or ThreadPoolExecutor(
                    max_workers=self.database.pool_max_size, thread_name_prefix="runcell-db"
                )
        return executor

    def track(self, loop: BackgroundLoop[Any]) -> None:
        """Stop ``loop`` (a key purger) when the engine closes."""
        with self._lock:
            self._check_open()
            self._loops.add(loop)

    def _check_open(self) -> None:
        if self.closed:
            raise ConcurrencyLimiterError(
                f"the PostgreSQL backend on {redacted(self.database.conninfo)} was closed"
            )

    def first_time(self, limiter: str, stored_hash: str) -> bool:
        """Whether this engine says for the first time that ``limiter`` uses the stored
        limits of ``stored_hash`` (``on_conflict="use_stored"``)."""
        with self._lock:
            new = (limiter, stored_hash) not in self._said
            self._said.add((limiter, stored_hash))
        return new

    def close(self) -> None:
        """End every thread this engine started and close every connection it opened;
        leases still held are no longer renewed, waiters are not served.
        """
        with self._lock:
            if self.closed:
                return
            self.closed = True
            room, executor = self._room, self._executor
            self._room = self._executor = None
        self.keeper.stop(CLOSE_TIMEOUT_S)
        for loop in list(self._loops):
            loop.stop(CLOSE_TIMEOUT_S)
        if room is not None:
            room.close()
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)
        self.database.close()


class HasEngine(Protocol):
    """Whatever gives a limiter this process's engine (its backend)."""

    @property
    def engine(self) -> Engine: ...

    def close(self) -> None: ...


class EngineShares:
    """The engines of this process: one per database and options, shared by every
    backend on them (two Celery apps and a script cost one pool, one listener, one keeper)
    and closed with the last backend's :meth:`give_back`. A forked child never uses its
    parent's entries.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._shares: dict[tuple[int, object, PostgresOptions], tuple[Engine, int]] = {}
        os.register_at_fork(after_in_child=self._after_fork)

    def _after_fork(self) -> None:
        self._lock = threading.Lock()  # a parent's thread may have held it
        self._shares = {}  # the parent's engines are the parent's

    def take(self, database: Database, options: PostgresOptions) -> Engine:
        """The engine of ``database`` and ``options``, counted as one more backend's."""
        key = (os.getpid(), database.identity, options)
        with self._lock:
            engine, count = self._shares.get(key, (None, 0))
            if engine is None or engine.closed:
                engine, count = Engine(database.fresh(), options), 0
            self._shares[key] = (engine, count + 1)
        return engine

    def give_back(self, engine: Engine) -> None:
        """One backend of ``engine`` closed: close the engine once none is left."""
        with self._lock:
            for key, (found, count) in list(self._shares.items()):
                if found is engine:
                    if count > 1:
                        self._shares[key] = (engine, count - 1)
                        return
                    del self._shares[key]
                    break
        engine.close()

    def give_back_later(self, engine: Engine) -> None:
        """:meth:`give_back` in a thread of its own, not waited for (a finalizer's);
        in a forked child, nothing (the parent's engine is the parent's)."""
        if not engine.closed and engine.pid == os.getpid():
            threading.Thread(
                target=self.give_back, args=(engine,), name="runcell-close", daemon=True
            ).start()


def engines() -> EngineShares:
    """This process's engines (see :class:`EngineShares`), a forked child's its own."""
    return DEFAULT_REGISTRY.local("postgres.engines", EngineShares)
