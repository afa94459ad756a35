"""The mixed workload the demo sends, and the live progress bar while it runs.

Background work arrives in a burst (summaries, and agents that fan out into more
summaries); interactive questions trickle in meanwhile, as users would ask them. A
quarter of the interactive requests are summaries a user asked for: the same task
as the batch ones, run in the ``interactive`` workload by a per-call override.
"""

from __future__ import annotations

import random
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, TextIO

import redis

from runcell_celery.testing import FakeProviderClient

from .worker_hooks import keys

__all__ = ["SIZES", "Plan", "Progress", "submit"]


@dataclass(frozen=True)
class Plan:
    """How much to send."""

    questions: int
    summaries: int
    agents: int
    documents_per_agent: int

    @property
    def tasks(self) -> int:
        """Task executions to expect (each agent sends its children)."""
        return self.questions + self.summaries + self.agents * (1 + self.documents_per_agent)


SIZES = {
    "small": Plan(questions=10, summaries=24, agents=2, documents_per_agent=4),
    "medium": Plan(questions=40, summaries=120, agents=4, documents_per_agent=6),
    "large": Plan(questions=100, summaries=500, agents=4, documents_per_agent=12),
}


def submit(plan: Plan, *, spread_s: float, seed: int | None = None) -> threading.Thread:
    """Send the workload from a thread: the batch at once, questions over ``spread_s``."""
    from agents.tasks import answer_question, research_agent, summarize_document
    from django.conf import settings

    rng = random.Random(seed)

    def send() -> None:
        batch = [("summary", i) for i in range(plan.summaries)]
        batch += [("agent", i) for i in range(plan.agents)]
        rng.shuffle(batch)
        for kind, i in batch:
            if kind == "agent":
                research_agent.delay(f"topic {i}", documents=plan.documents_per_agent)
            else:
                summarize_document.delay(f"report-{i:04d}")
        gap = spread_s / max(1, plan.questions)
        for i in range(plan.questions):
            time.sleep(rng.uniform(0.5, 1.5) * gap)
            if i % 4 == 3:
                summarize_document.apply_async(
                    (f"user-upload-{i}",),
                    concurrency={"workload": "interactive"},  # a user is waiting for this one
                    queue=settings.INTERACTIVE_QUEUE,
                )
            else:
                answer_question.delay(f"question {i}")

    thread = threading.Thread(target=send, name="demo-submit", daemon=True)
    thread.start()
    return thread


@dataclass(frozen=True)
class Finished:
    """How the workload ended."""

    succeeded: int
    failed: int
    expected: int
    seconds: float

    @property
    def complete(self) -> bool:
        return self.succeeded + self.failed >= self.expected


class Progress:
    """A one-line live progress bar (a line every few seconds when not on a terminal)."""

    def __init__(
        self,
        plan: Plan,
        *,
        redis_url: str,
        run: str,
        provider: FakeProviderClient,
        limit: int,
        out: TextIO = sys.stdout,
    ) -> None:
        self.plan = plan
        self.provider = provider
        self.limit = limit
        self.out = out
        self._redis = redis.Redis.from_url(redis_url)
        self._key = keys(run)["progress"]
        self._tty = out.isatty()
        encoding = (getattr(out, "encoding", None) or "").lower()
        self._full, self._empty = ("█", "░") if encoding.startswith("utf") else ("#", "-")

    def counts(self) -> tuple[int, int]:
        raw: dict[Any, Any] = self._redis.hgetall(self._key)
        values = {k.decode(): int(v) for k, v in raw.items()}
        return values.get("succeeded", 0), values.get("failed", 0)

    def wait(self, timeout_s: float, *, stall_s: float = 30.0) -> Finished:
        """Draw the bar until every task finished, ``timeout_s`` passed, or nothing
        moved for ``stall_s`` (no task finished, no provider call in flight): then the
        summary says so at once instead of waiting out the timeout."""
        started = time.monotonic()
        last_line = 0.0
        last_change, last_seen = started, (-1, -1, -1)
        while True:
            succeeded, failed = self.counts()
            stats = self.provider.stats()
            now = time.monotonic()
            elapsed = now - started
            seen = (succeeded, failed, stats.total)
            if seen != last_seen or stats.in_flight:
                last_change, last_seen = now, seen
            stalled = now - last_change > stall_s
            done = succeeded + failed >= self.plan.tasks
            line = self._line(
                succeeded + failed, failed, stats.in_flight, stats.max_in_flight, elapsed
            )
            if self._tty:
                self.out.write("\r" + line + ("\n" if done else ""))
                self.out.flush()
            elif done or elapsed - last_line >= 3:
                self.out.write(line + "\n")
                self.out.flush()
                last_line = elapsed
            if done or stalled or elapsed > timeout_s:
                if not done and self._tty:
                    self.out.write("\n")
                if stalled and not done:
                    self.out.write(f"  nothing moved for {stall_s:.0f} s: stopping the wait\n")
                return Finished(succeeded, failed, self.plan.tasks, elapsed)
            time.sleep(0.2)

    def _line(self, finished: int, failed: int, in_flight: int, most: int, elapsed: float) -> str:
        total = self.plan.tasks
        width = 28
        filled = min(width, round(width * finished / max(1, total)))
        bar = self._full * filled + self._empty * (width - filled)
        failures = f", {failed} failed" if failed else ""
        return (
            f"  {bar} {finished:>4}/{total} tasks{failures} | provider in flight "
            f"{in_flight}/{self.limit} (max seen {most}) | {elapsed:5.1f} s"
        )
