"""The event recorder: concurrency events to ``runcell_event``, off the hot path.

An event listener that only appends to a bounded buffer, so the emitting thread never
waits on the database; the thread ``runcell-event-recorder`` writes batches every
``FLUSH_INTERVAL_MS`` (sooner when a batch is ready) and samples occupancy every
``SAMPLE_INTERVAL_MS``. A full buffer drops events and counts them as ``events-dropped``
rows. Fork-safe: the buffer is a :class:`~runcell_celery.background.ProcessLocal`, and a
child starts its own writer on its first event (the parent's buffer is the parent's).
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any, cast

from django.conf import settings
from django.db import connections
from django.db.models import Field
from django.utils import timezone

from runcell_celery import add_event_listener, remove_event_listener
from runcell_celery.background import DEFAULT_REGISTRY, BackgroundLoop, ProcessLocal
from runcell_celery.events import ConcurrencyEvent as CoreEvent

from . import conf
from .event_types import EVENTS_DROPPED
from .managers import write_alias
from .models import ConcurrencyEvent, OccupancySample

__all__ = ["EventRecorder", "RecorderStats", "start_recorder", "stop_recorder"]

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


#: The event's text attributes kept as they are, cut to their column's length.
_CUT = (
    *("key", "workload", "run_id", "root_run_id", "parent_run_id", "request_id"),
    *("holder_name", "lease_id", "outcome", "reason"),
)


def _cut(column: str, value: str | None) -> str | None:
    """``value`` cut to the length of the ``runcell_event`` column ``column``."""
    length = cast("Field[Any, Any]", ConcurrencyEvent._meta.get_field(column)).max_length
    return value if value is None or length is None else value[:length]


class _Buffer:
    """One process's buffered events and counters (a child starts with a new one)."""

    def __init__(self, sample_interval_ms: int) -> None:
        self.lock = threading.Lock()
        self.events: deque[CoreEvent] = deque()
        self.unreported_drops: Counter[str] = Counter()
        self.recorded = 0
        self.dropped = 0
        #: Set when a batch is ready (or on stop): the writer does not wait the interval.
        self.wake = threading.Event()
        self.next_sample = time.monotonic() + sample_interval_ms / 1000
        self.last_error_log = 0.0


class EventRecorder:
    """Records the concurrency events of this process in PostgreSQL (options as
    ``RUNCELL["EVENTS"]``'s; ``sample_interval_ms=0``: no occupancy samples)."""

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
        self._buffer = ProcessLocal(lambda: _Buffer(sample_interval_ms))
        self._loop = BackgroundLoop(THREAD_NAME, self, EventRecorder._step)

    def __call__(self, event: CoreEvent) -> None:
        """Buffer ``event`` for the writer thread; drop and count it if the buffer is full."""
        buffer = self._buffer.get()
        with buffer.lock:
            if len(buffer.events) >= self.buffer_size:
                buffer.dropped += 1
                buffer.unreported_drops[event.limiter] += 1
                return
            buffer.events.append(event)
            batch_ready = len(buffer.events) >= self.batch_size
        if batch_ready:
            buffer.wake.set()
        if self._listening and not self._loop.running:
            self._loop.start()  # first event after a fork: this process's own thread

    @property
    def running(self) -> bool:
        """Whether this process's writer thread runs."""
        return self._loop.running

    def start(self) -> None:
        """Listen to this process's events and start the writer thread."""
        self._listening = True
        add_event_listener(self)
        self._loop.start()

    def stop(self, *, timeout: float = 10.0, flush: bool = True) -> None:
        """Stop listening and stop the thread, then (``flush``) write what is left here."""
        self._listening = False
        remove_event_listener(self)
        self._loop.stopping.set()
        self._buffer.get().wake.set()
        self._loop.stop(timeout)
        if not flush:
            return
        try:
            self.flush()
        except Exception:
            logger.exception("runcell: writing the last events failed")

    def stats(self) -> RecorderStats:
        buffer = self._buffer.get()
        with buffer.lock:
            buffered = len(buffer.events)
            return RecorderStats(buffered, buffer.recorded, buffer.dropped, self.buffer_size)

    def flush(self) -> int:
        """Write every buffered event now; return how many were written (if the database
        fails, the batch is counted as dropped and the error raised)."""
        buffer = self._buffer.get()
        written = 0
        while True:
            with buffer.lock:
                size = min(self.batch_size, len(buffer.events))
                batch = [buffer.events.popleft() for _ in range(size)]
                drops = dict(buffer.unreported_drops)
                buffer.unreported_drops.clear()
            if not batch and not drops:
                return written
            rows = [self._row(event) for event in batch] + self._drop_rows(drops)
            try:
                ConcurrencyEvent.objects.using(write_alias(ConcurrencyEvent)).bulk_create(rows)
            except Exception:
                with buffer.lock:
                    buffer.dropped += len(batch)
                    buffer.unreported_drops.update(event.limiter for event in batch)
                    buffer.unreported_drops.update(drops)
                raise
            with buffer.lock:
                buffer.recorded += len(batch)
            written += len(batch)

    def sample_occupancy(self) -> None:
        """Record slots held and queued per workload, unless this interval has a sample."""
        OccupancySample.objects.sample(self.sample_interval_ms or 10_000)

    def _step(self) -> float | None:
        """One round of the writer thread: wait for a batch or the interval, flush, then
        sample when it is time."""
        buffer = self._buffer.get()
        buffer.wake.wait(self.flush_interval_s)
        buffer.wake.clear()
        if self._loop.stopping.is_set():
            connections.close_all()  # this thread's connections only
            return None
        try:
            self.flush()
            if self.sample_interval_ms and time.monotonic() >= buffer.next_sample:
                buffer.next_sample = time.monotonic() + self.sample_interval_ms / 1000
                self.sample_occupancy()
        except Exception as exc:
            connections[write_alias(ConcurrencyEvent)].close()  # reconnect next time
            now = time.monotonic()
            if now - buffer.last_error_log >= _LOG_EVERY_S:
                buffer.last_error_log = now
                logger.warning("runcell: recording events failed (will retry): %s", exc)
        return 0

    def _row(self, event: CoreEvent) -> ConcurrencyEvent:
        row = ConcurrencyEvent(
            type=event.type,
            occurred_at=_when(event.timestamp),
            limiter=_cut("limiter", event.limiter) or "",
            limiters=None if event.limiters is None else [n[:200] for n in event.limiters],
            host=_cut("host", self._host),
            pid=os.getpid(),
            deadline=None if event.deadline is None else _when(event.deadline),
            fencing_token=event.fencing_token,
            wait_ms=None if event.wait_ms is None else round(event.wait_ms, 3),
            hold_ms=None if event.hold_ms is None else round(event.hold_ms, 3),
            error=event.error,
        )
        for name in _CUT:
            setattr(row, name, _cut(name, getattr(event, name)))
        return row

    def _drop_rows(self, drops: dict[str, int]) -> list[ConcurrencyEvent]:
        now = _when(time.time())
        return [
            ConcurrencyEvent(
                type=EVENTS_DROPPED,
                occurred_at=now,
                limiter=_cut("limiter", limiter) or "",
                host=_cut("host", self._host),
                pid=os.getpid(),
                dropped=count,
            )
            for limiter, count in sorted(drops.items())
        ]


def start_recorder() -> EventRecorder | None:
    """Start this process's recorder as ``RUNCELL["EVENTS"]`` says (once)."""
    options = conf.event_settings()
    if not options.enabled:
        return None
    with DEFAULT_REGISTRY.lock("django.recorder"):
        _recorder: EventRecorder | None = DEFAULT_REGISTRY.value("django.recorder", None)
        if _recorder is None:
            names = ("buffer_size", "flush_interval_ms", "batch_size", "sample_interval_ms")
            _recorder = EventRecorder(**{name: getattr(options, name) for name in names})
            _recorder.start()
            DEFAULT_REGISTRY.put("django.recorder", _recorder)
        return _recorder


def stop_recorder() -> None:
    """Stop this process's recorder after writing what it buffered."""
    with DEFAULT_REGISTRY.lock("django.recorder"):
        recorder: EventRecorder | None = DEFAULT_REGISTRY.value("django.recorder", None)
        DEFAULT_REGISTRY.put("django.recorder", None)
    if recorder is not None:
        recorder.stop()
