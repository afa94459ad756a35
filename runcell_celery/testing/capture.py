"""Capture the concurrency events a test caused, to assert on them.

Events are delivered in the thread that emits them (a worker's pool thread, the lease
keeper), so the capture is thread-safe and can wait for an event another thread is
about to emit. It listens from :meth:`EventCapture.start` to :meth:`EventCapture.stop`
(or the ``with`` block), so events of earlier tests never leak into it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from types import TracebackType
from typing import Self

from ..events import ConcurrencyEvent, EventType, add_event_listener, remove_event_listener

__all__ = ["EventCapture"]


class EventCapture:
    """Every :class:`~runcell_celery.ConcurrencyEvent` of this process while started.

    Filters match the event's fields: ``limiter`` (``"tenant:acme"`` for a key's),
    ``workload`` and ``holder`` (the holder's name: a Celery task's name).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._events: list[ConcurrencyEvent] = []

    def start(self) -> Self:
        add_event_listener(self._record)
        return self

    def stop(self) -> None:
        remove_event_listener(self._record)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _record(self, event: ConcurrencyEvent) -> None:
        with self._cond:
            self._events.append(event)
            self._cond.notify_all()

    @property
    def events(self) -> list[ConcurrencyEvent]:
        """Every event captured so far, in the order they were emitted."""
        with self._cond:
            return list(self._events)

    def __iter__(self) -> Iterator[ConcurrencyEvent]:
        return iter(self.events)

    def __len__(self) -> int:
        with self._cond:
            return len(self._events)

    def of(
        self,
        type_: EventType | None = None,
        *,
        limiter: str | None = None,
        workload: str | None = None,
        holder: str | None = None,
    ) -> list[ConcurrencyEvent]:
        """The events of ``type_`` (any type when ``None``) that match the filters."""
        with self._cond:
            return [e for e in self._events if _matches(e, type_, limiter, workload, holder)]

    def count(
        self,
        type_: EventType,
        *,
        limiter: str | None = None,
        workload: str | None = None,
        holder: str | None = None,
    ) -> int:
        """How many events of ``type_`` match the filters."""
        return len(self.of(type_, limiter=limiter, workload=workload, holder=holder))

    def types(
        self,
        *,
        limiter: str | None = None,
        workload: str | None = None,
        holder: str | None = None,
    ) -> list[str]:
        """The types of the matching events, in order (e.g. to compare with a list)."""
        return [e.type for e in self.of(None, limiter=limiter, workload=workload, holder=holder)]

    def wait_for(
        self,
        type_: EventType,
        *,
        limiter: str | None = None,
        workload: str | None = None,
        holder: str | None = None,
        timeout: float = 10.0,
    ) -> ConcurrencyEvent:
        """Return the first matching event of ``type_``, waiting up to ``timeout`` s.

        :raises AssertionError: none came in time; the message lists what did.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for event in self._events:
                    if _matches(event, type_, limiter, workload, holder):
                        return event
                left = deadline - time.monotonic()
                if left <= 0:
                    seen = [(e.type, e.limiter, e.workload, e.holder_name) for e in self._events]
                    raise AssertionError(
                        f"no {type_!r} event (limiter={limiter!r}, workload={workload!r}, "
                        f"holder={holder!r}) within {timeout} s; captured: {seen}"
                    )
                self._cond.wait(left)


def _matches(
    event: ConcurrencyEvent,
    type_: str | None,
    limiter: str | None,
    workload: str | None,
    holder: str | None,
) -> bool:
    return (
        (type_ is None or event.type == type_)
        and (limiter is None or event.limiter == limiter)
        and (workload is None or event.workload == workload)
        and (holder is None or event.holder_name == holder)
    )
