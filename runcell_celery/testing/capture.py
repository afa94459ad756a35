"""Capture the concurrency events a test caused, to assert on them.

Events are delivered in the thread that emits them (a worker's pool thread, the lease
keeper), so the capture is thread-safe and can wait for an event another thread is about
to emit. It listens only while started (or in its ``with`` block), so events of earlier
tests never leak into it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from types import MappingProxyType
from typing import Self

from ..events import ConcurrencyEvent, EventType, add_event_listener, remove_event_listener

__all__ = ["EventCapture"]

#: The filters, and the event field each matches.
_FILTERS = MappingProxyType({"limiter": "limiter", "workload": "workload", "holder": "holder_name"})


class EventCapture:
    """Every :class:`~runcell_celery.ConcurrencyEvent` of this process while started.

    Filters match the event's fields: ``limiter`` (``"tenant:acme"`` for a key's),
    ``workload`` and ``holder`` (the holder's name: a Celery task's name); ``None``
    matches anything.
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

    def __exit__(self, *exc_info: object) -> None:
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

    def of(self, type_: EventType | None = None, **filters: str | None) -> list[ConcurrencyEvent]:
        """The events of ``type_`` (any type when ``None``) that match the filters."""
        return list(filter(_matcher(type_, filters), self.events))

    def count(self, type_: EventType, **filters: str | None) -> int:
        """How many events of ``type_`` match the filters."""
        return len(self.of(type_, **filters))

    def types(self, **filters: str | None) -> list[str]:
        """The types of the matching events, in order (e.g. to compare with a list)."""
        return [e.type for e in self.of(None, **filters)]

    def wait_for(
        self, type_: EventType, *, timeout: float = 10.0, **filters: str | None
    ) -> ConcurrencyEvent:
        """Return the first matching event of ``type_``, waiting up to ``timeout`` s.

        :raises AssertionError: none came in time; the message lists what did.
        """
        matches, deadline = _matcher(type_, filters), time.monotonic() + timeout
        with self._cond:
            while True:
                if (event := next(filter(matches, self._events), None)) is not None:
                    return event
                left = deadline - time.monotonic()
                if left <= 0:
                    seen = [(e.type, e.limiter, e.workload, e.holder_name) for e in self._events]
                    given = ", ".join(f"{k}={v!r}" for k, v in filters.items())
                    raise AssertionError(
                        f"no {type_!r} event ({given}) within {timeout} s; captured: {seen}"
                    )
                self._cond.wait(left)


def _matcher(
    type_: str | None, filters: dict[str, str | None]
) -> Callable[[ConcurrencyEvent], bool]:
    if unknown := filters.keys() - _FILTERS.keys():
        raise TypeError(f"unknown event filters {sorted(unknown)}: use {', '.join(_FILTERS)}")
    wanted = [(_FILTERS[name], value) for name, value in filters.items() if value is not None]
    return lambda e: (
        (type_ is None or e.type == type_)
        and all(getattr(e, field) == value for field, value in wanted)
    )
