"""The event recorder: concurrency events to ``runcell_event``, off the hot path.

The recorder is an event listener (:func:`runcell_celery.add_event_listener`) that
only appends the event to a bounded in-memory buffer: the thread that emitted it (a
provider call's, or the lease keeper's) never waits on the database. A named daemon
thread, ``runcell-event-recorder``, writes the buffer in batches (``bulk_create``)
every ``FLUSH_INTERVAL_MS``, or sooner when a batch is ready. When the buffer is full
(the database is slow or down), new events are dropped and counted; the counts are
written as ``events-dropped`` rows, so the admin shows what is missing.

The same thread samples slot occupancy every ``SAMPLE_INTERVAL_MS`` for the dashboard
(one sample per interval for the whole fleet, whichever process is first).

Fork-safe: a child process (Celery prefork) starts with an empty buffer and its own
thread and database connection, on its first event; the parent's buffered events are
the parent's to write.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
import time
import weakref
from collections import Counter, deque
from dataclasses import dataclass

from django.conf import settings
from django.db import connections
from django.utils import timezone

from runcell_celery import add_event_listener, remove_event_listener
from runcell_celery.events import ConcurrencyEvent as CoreEvent

from . import conf, sql
from .managers import write_alias
from .models import EVENTS_DROPPED, ConcurrencyEvent

__all__ = ["EventRecorder", "RecorderStats", "get_recorder", "start_recorder", "stop_recorder"]

logger = logging.getLogger("runcell_django.recorder")

THREAD_NAME = "runcell-event-recorder"
#: Log a failing write at most this often (the recorder retries every interval).
_LOG_EVERY_S = 60.0


@dataclass(frozen=True, slots=True)
class RecorderStats:
    """What this process's recorder did since it started (or since the fork)."""

    buffered: int
    recorded: int
    dropped: int
    buffer_size: int


def _when(timestamp: float) -> datetime.datetime:
    moment = datetime.datetime.fromtimestamp(timestamp, tz=datetime.UTC)
    return moment if settings.USE_TZ else timezone.make_naive(moment)


def _cut(value: str | None, length: int) -> str | None:
    return value if value is None or len(value) <= length else value[:length]


class EventRecorder:
    """Records the concurrency events of this process in PostgreSQL.

    :param buffer_size: most events held before new ones are dropped (and counted).
    :param flush_interval_ms: how often the thread writes the buffer.
    :param batch_size: most rows per ``INSERT``; a full batch wakes the thread early.
    :param sample_interval_ms: how often to sample occupancy; ``0``: never.
    """

    def __init__(
        self,
        *,
        buffer_size: int = 10_000,
        flush_interval_ms: int = 1_000,
        batch_size: int = 500,
        sample_interval_ms: int = 0,
    ) -> None:
        self.buffer_size = buffer_size
        self.batch_size = batch_size
        self.flush_interval_s = flush_interval_ms / 1000
        self.sample_interval_ms = sample_interval_ms
        self._host = socket.gethostname()
        self._listening = False
        self._reset()
        _recorders.add(self)

    def _reset(self) -> None:
        """Start from nothing: at creation, and in a forked child."""
        self._lock = threading.Lock()
        self._buffer: deque[CoreEvent] = deque()
        self._unreported_drops: Counter[str] = Counter()
        self._recorded = 0
        self._dropped = 0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._next_sample = time.monotonic() + self.sample_interval_ms / 1000
        self._last_error_log = 0.0

    # -- the listener: the only part on the hot path ----------------------------------

    def __call__(self, event: CoreEvent) -> None:
        """Buffer ``event`` for the writer thread; drop and count it if the buffer is full."""
        with self._lock:
            if len(self._buffer) >= self.buffer_size:
                self._dropped += 1
                self._unreported_drops[event.limiter] += 1
                return
            self._buffer.append(event)
            batch_ready = len(self._buffer) >= self.batch_size
        if batch_ready:
            self._wake.set()
        if self._thread is None and self._listening:
            self._start_thread()  # first event after start() or after a fork

    # -- lifecycle --------------------------------------------------------------------

    def start(self) -> None:
        """Listen to this process's events and start the writer thread."""
        self._listening = True
        add_event_listener(self)
        self._start_thread()

    def stop(self, *, timeout: float = 10.0) -> None:
        """Stop listening, stop the thread, then write what is left (in this thread)."""
        self._listening = False
        remove_event_listener(self)
        thread = self._thread
        self._stop.set()
        self._wake.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        self._thread = None
        try:
            self.flush()
        except Exception:
            logger.exception("runcell: writing the last events failed")

    def _start_thread(self) -> None:
        with self._lock:
            if self._thread is not None:
                return
            self._stop = threading.Event()
            thread = threading.Thread(
                target=_write_forever,
                args=(weakref.ref(self), self._stop, self._wake, self.flush_interval_s),
                name=THREAD_NAME,
                daemon=True,
            )
            self._thread = thread
        thread.start()

    def _after_fork_in_child(self) -> None:
        listening = self._listening
        self._reset()
        self._listening = listening  # the thread starts again on the child's first event

    # -- writing ----------------------------------------------------------------------

    def stats(self) -> RecorderStats:
        with self._lock:
            return RecorderStats(
                buffered=len(self._buffer),
                recorded=self._recorded,
                dropped=self._dropped,
                buffer_size=self.buffer_size,
            )

    def flush(self) -> int:
        """Write every buffered event now; return how many were written.

        :raises Exception: the database failed; the batch is counted as dropped.
        """
        written = 0
        while True:
            with self._lock:
                size = min(self.batch_size, len(self._buffer))
                batch = [self._buffer.popleft() for _ in range(size)]
                drops = dict(self._unreported_drops)
                self._unreported_drops.clear()
            if not batch and not drops:
                return written
            rows = [self._row(event) for event in batch] + self._drop_rows(drops)
            try:
                ConcurrencyEvent.objects.using(write_alias(ConcurrencyEvent)).bulk_create(rows)
            except Exception:
                with self._lock:
                    self._dropped += len(batch)
                    self._unreported_drops.update(event.limiter for event in batch)
                    self._unreported_drops.update(drops)
                raise
            with self._lock:
                self._recorded += len(batch)
            written += len(batch)

    def sample_occupancy(self) -> None:
        """Record slots held and queued per workload, unless this interval has a sample."""
        interval_ms = self.sample_interval_ms or 10_000
        alias = write_alias(ConcurrencyEvent)
        with connections[alias].cursor() as cursor:
            cursor.execute(sql.SAMPLE_OCCUPANCY, {"interval_ms": interval_ms})

    def _tick(self) -> None:
        """One round of the writer thread: flush, then sample when it is time."""
        try:
            self.flush()
            if self.sample_interval_ms and time.monotonic() >= self._next_sample:
                self._next_sample = time.monotonic() + self.sample_interval_ms / 1000
                self.sample_occupancy()
        except Exception as exc:
            connections[write_alias(ConcurrencyEvent)].close()  # reconnect next time
            now = time.monotonic()
            if now - self._last_error_log >= _LOG_EVERY_S:
                self._last_error_log = now
                logger.warning("runcell: recording events failed (will retry): %s", exc)

    def _row(self, event: CoreEvent) -> ConcurrencyEvent:
        return ConcurrencyEvent(
            type=event.type,
            occurred_at=_when(event.timestamp),
            limiter=_cut(event.limiter, 200) or "",
            workload=_cut(event.workload, 200),
            run_id=_cut(event.run_id, 255),
            root_run_id=_cut(event.root_run_id, 255),
            parent_run_id=_cut(event.parent_run_id, 255),
            request_id=_cut(event.request_id, 255),
            holder_name=_cut(event.holder_name, 255),
            host=_cut(self._host, 255),
            pid=os.getpid(),
            deadline=None if event.deadline is None else _when(event.deadline),
            lease_id=_cut(event.lease_id, 100),
            fencing_token=event.fencing_token,
            wait_ms=None if event.wait_ms is None else round(event.wait_ms, 3),
            hold_ms=None if event.hold_ms is None else round(event.hold_ms, 3),
            outcome=_cut(event.outcome, 32),
            reason=_cut(event.reason, 32),
            error=event.error,
        )

    def _drop_rows(self, drops: dict[str, int]) -> list[ConcurrencyEvent]:
        now = _when(time.time())
        return [
            ConcurrencyEvent(
                type=EVENTS_DROPPED,
                occurred_at=now,
                limiter=_cut(limiter, 200) or "",
                host=_cut(self._host, 255),
                pid=os.getpid(),
                dropped=count,
            )
            for limiter, count in sorted(drops.items())
        ]


def _write_forever(
    ref: weakref.ref[EventRecorder],
    stop: threading.Event,
    wake: threading.Event,
    interval_s: float,
) -> None:
    try:
        while not stop.is_set():
            wake.wait(interval_s)
            wake.clear()
            recorder = ref()
            if recorder is None:
                return
            recorder._tick()
            del recorder
    finally:
        connections.close_all()  # this thread's connections only


_recorders: weakref.WeakSet[EventRecorder] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for recorder in list(_recorders):
        recorder._after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)

_recorder: EventRecorder | None = None
_recorder_lock = threading.Lock()


def start_recorder() -> EventRecorder | None:
    """Start this process's recorder as ``RUNCELL["EVENTS"]`` says (once)."""
    global _recorder
    options = conf.event_settings()
    if not options.enabled:
        return None
    with _recorder_lock:
        if _recorder is None:
            _recorder = EventRecorder(
                buffer_size=options.buffer_size,
                flush_interval_ms=options.flush_interval_ms,
                batch_size=options.batch_size,
                sample_interval_ms=options.sample_interval_ms,
            )
            _recorder.start()
        return _recorder


def get_recorder() -> EventRecorder | None:
    """This process's recorder, if :func:`start_recorder` started one."""
    return _recorder


def stop_recorder() -> None:
    """Stop this process's recorder after writing what it buffered."""
    global _recorder
    with _recorder_lock:
        recorder, _recorder = _recorder, None
    if recorder is not None:
        recorder.stop()
