"""The fake provider's configuration and counters, without any I/O, so the counting
rules (what is in flight, which outcome a request ends in, when a fencing token is
stale) read in one place."""

from __future__ import annotations

import dataclasses
import random
import threading
from dataclasses import dataclass
from typing import Literal

from .wire import FakeProviderStats

__all__ = ["Counters", "FakeProviderConfig", "Latency", "Outcome", "RequestEndedError", "Visit"]

Outcome = Literal["completed", "errors", "rejected_stale", "disconnected"]
Latency = float | tuple[float, float]

#: Every counter of :class:`~.wire.FakeProviderStats` (all its fields but the tokens).
_COUNTERS = tuple(f.name for f in dataclasses.fields(FakeProviderStats))[:-1]


@dataclass(frozen=True)
class FakeProviderConfig:
    """How the fake provider behaves; validated on creation.

    ``latency_ms`` is fixed or a ``(low, high)`` uniform range, for requests naming
    none. ``error_rate`` is the share answered 529 "overloaded", drawn from
    ``random.Random(seed)`` so a seeded run repeats. ``strict_fencing`` rejects a token
    lower than the highest seen for its limiter; it is off by default because under a
    limit of N > 1 concurrent holders legitimately carry different tokens (fencing
    protects a single-writer resource), so turn it on only to witness a limit of one.
    """

    latency_ms: Latency = 50.0
    error_rate: float = 0.0
    seed: int | None = None
    strict_fencing: bool = False
    chunks: int = 5

    def __post_init__(self) -> None:
        low, high = self.latency_bounds
        if not 0 <= low <= high:
            raise ValueError(f"latency_ms must be >= 0 (low <= high), got {self.latency_ms!r}")
        if not 0.0 <= self.error_rate <= 1.0:
            raise ValueError(f"error_rate must be between 0 and 1, got {self.error_rate!r}")
        if self.chunks < 1:
            raise ValueError(f"chunks must be >= 1, got {self.chunks!r}")

    @property
    def latency_bounds(self) -> tuple[float, float]:
        latency = self.latency_ms
        return (latency, latency) if isinstance(latency, int | float) else latency


class Counters:
    """The counters and fencing memory, behind one lock (handlers run on many threads)."""

    def __init__(self, config: FakeProviderConfig) -> None:
        self._config = config
        self._lock = threading.Condition()
        self._rng = random.Random(config.seed)
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self._tokens: dict[str, int] = {}

    def reset(self) -> FakeProviderStats:
        """Zero the counters, forget fencing tokens and reseed the draws.

        Requests still in flight are carried over (as ``in_flight``, ``max_in_flight``
        and ``total``): they will end and be counted, so the counts still add up.
        """
        with self._lock:
            carried = self._counts["in_flight"]
            self._counts = dict.fromkeys(_COUNTERS, 0)
            self._counts.update(in_flight=carried, max_in_flight=carried, total=carried)
            self._tokens.clear()
            self._rng.seed(self._config.seed)
            return self.snapshot()

    def snapshot(self) -> FakeProviderStats:
        with self._lock:
            return FakeProviderStats(**self._counts, fencing_tokens=dict(self._tokens))

    def arrive(self) -> Visit:
        """Count a new request in flight; draw its default latency and whether it fails."""
        with self._lock:
            counts = self._counts
            counts["total"] += 1
            counts["in_flight"] += 1
            counts["max_in_flight"] = max(counts["max_in_flight"], counts["in_flight"])
            latency_ms = self._rng.uniform(*self._config.latency_bounds)
            fails = self._rng.random() < self._config.error_rate
        return Visit(self, latency_ms, fails)

    def finish(self, outcome: Outcome) -> None:
        with self._lock:
            self._counts["in_flight"] -= 1
            self._counts[outcome] += 1
            self._lock.notify_all()

    def fence(self, limiter: str, token: int) -> int | None:
        """Remember ``token``; return the higher token it is stale against, if rejected."""
        with self._lock:
            highest = self._tokens.get(limiter)
            if self._config.strict_fencing and highest is not None and token < highest:
                return highest
            self._tokens[limiter] = token if highest is None else max(highest, token)
            return None

    def wait_idle(self, timeout: float) -> FakeProviderStats:
        """Wait until no request is in flight and return the counters then."""
        with self._lock:
            if not self._lock.wait_for(lambda: self._counts["in_flight"] == 0, timeout):
                raise TimeoutError(f"requests still in flight after {timeout}s")
            return self.snapshot()


@dataclass
class Visit:
    """One request's stay in flight: ``finish`` counts its outcome once (later calls no-op)."""

    counters: Counters
    latency_ms: float
    fails: bool
    finished: bool = False

    def finish(self, outcome: Outcome) -> None:
        if not self.finished:
            self.finished = True
            self.counters.finish(outcome)


class RequestEndedError(Exception):
    """Raised inside a handler to end a failed request once its outcome is counted."""

    def __init__(self, outcome: Outcome) -> None:
        super().__init__(outcome)
        self.outcome = outcome
