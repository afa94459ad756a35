"""The clock the in-memory limiter reads, injectable so tests need no real waiting."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

__all__ = ["SYSTEM_CLOCK", "Clock", "SystemClock"]


class Clock(Protocol):
    """Monotonic seconds for deadlines and expiry, wall seconds for event timestamps."""

    def monotonic(self) -> float: ...

    def time(self) -> float: ...


@dataclass(frozen=True)
class SystemClock:
    """The real clocks: :func:`time.monotonic` and :func:`time.time`."""

    monotonic = staticmethod(time.monotonic)
    time = staticmethod(time.time)


SYSTEM_CLOCK: Clock = SystemClock()
