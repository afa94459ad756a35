"""Time budgets: one :class:`Deadline` value, monotonic inside, converted only at the edges.

Host clocks differ and jump; the monotonic clock means nothing outside its process. So
a deadline is a ``time.monotonic()`` instant inside a process and crosses a boundary
only as milliseconds left (to the database; in a message, against an anchor both sides
read, :mod:`runcell_celery.celery.headers`). The Unix forms are for display only.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

__all__ = ["Deadline"]


@dataclass(frozen=True, slots=True, order=True)
class Deadline:
    """An instant on this process's monotonic clock by which something must end."""

    at: float

    @classmethod
    def after_ms(cls, ms: float, *, now: float | None = None) -> Deadline:
        """The deadline ``ms`` milliseconds from ``now`` (monotonic; default: now)."""
        if not math.isfinite(ms):
            raise ValueError(f"a deadline needs a finite duration, not {ms!r} ms")
        start = time.monotonic() if now is None else now
        return cls(start + ms / 1000)

    @staticmethod
    def earliest(*deadlines: Deadline | None) -> Deadline | None:
        """The earliest of the given deadlines; ``None`` if none is given."""
        given = [d for d in deadlines if d is not None]
        return min(given) if given else None

    def remaining_ms(self, *, now: float | None = None) -> float:
        """Milliseconds left (negative once passed)."""
        return (self.at - (time.monotonic() if now is None else now)) * 1000

    def remaining_s(self, *, now: float | None = None) -> float:
        """Seconds left, never below zero (for ``wait(timeout)`` calls)."""
        return max(0.0, self.at - (time.monotonic() if now is None else now))

    def passed(self, *, now: float | None = None) -> bool:
        return (time.monotonic() if now is None else now) >= self.at

    def to_unix(self) -> float:
        """This instant on the host's wall clock, for display only."""
        return time.time() + (self.at - time.monotonic())

    @classmethod
    def from_unix(cls, timestamp: float) -> Deadline:
        """The monotonic instant of a wall-clock timestamp read on this host."""
        return cls(time.monotonic() + (timestamp - time.time()))
