"""Races with real threads and asyncio tasks: the limit holds under cancels and timeouts.

An independent witness counts the holders inside the slot body (a lock and a counter,
nothing from the library), and records the most it ever saw. Every run asserts both
that the most never went above the limit and that it reached the limit, so a run
that never contended proves nothing and fails. Afterwards the limiter must be idle:
nothing held, nothing queued, no hold left with the lease keeper.

The default suite runs one fixed 32 threads x 200 slot uses run. Longer variants are
marked ``stress`` and sized by ``RUNCELL_STRESS_SCALE`` (``small`` by default, ``ci``
for the bounded CI run, ``soak`` for a long local run).
"""

from __future__ import annotations

import asyncio
import os
import queue
import random
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

from runcell_celery import (
    CancellationToken,
    ConcurrencyCancelledError,
    ConcurrencyTimeoutError,
    InMemoryConcurrencyLimiter,
    create_concurrency_limiter,
    run,
    slot,
)
from runcell_celery.keeper import get_keeper

SOON_S = 10.0


@dataclass(frozen=True)
class Scale:
    threads: int
    uses: int
    tasks: int
    task_uses: int


SCALES = {
    "small": Scale(threads=32, uses=400, tasks=200, task_uses=20),
    "ci": Scale(threads=64, uses=1_000, tasks=500, task_uses=40),
    "soak": Scale(threads=128, uses=5_000, tasks=2_000, task_uses=200),
}


def stress_scale() -> Scale:
    name = os.environ.get("RUNCELL_STRESS_SCALE", "small")
    if name not in SCALES:
        pytest.fail(f"RUNCELL_STRESS_SCALE={name!r}; valid: {', '.join(SCALES)}")
    return SCALES[name]


class Witness:
    """Counts holders inside slot bodies, in total and per workload."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._inside: Counter[str] = Counter()
        self.most: Counter[str] = Counter()
        self.entries = 0

    def enter(self, workload: str) -> None:
        with self._lock:
            self._inside[workload] += 1
            self._inside["total"] += 1
            for key in (workload, "total"):
                self.most[key] = max(self.most[key], self._inside[key])
            self.entries += 1
            self._changed.notify_all()

    def linger(self, timeout: float) -> None:
        """Hold on (up to ``timeout`` s) until every limit has been seen full once.

        Random short holds reach the limits on an idle machine but not always on a loaded
        one; holders that wait for the others make the contention happen anyway, and stop
        waiting once it has, so the rest of the run stays random."""
        with self._changed:
            self._changed.wait_for(
                lambda: self.most["total"] >= 8 and self.most["background"] >= 5, timeout
            )

    def leave(self, workload: str) -> None:
        with self._lock:
            self._inside[workload] -= 1
            self._inside["total"] -= 1


class Canceller:
    """A thread that cancels tokens handed to it, each after a short random delay."""

    def __init__(self, seed: int) -> None:
        self._tokens: queue.Queue[CancellationToken | None] = queue.Queue()
        self._rng = random.Random(seed)
        self._thread = threading.Thread(target=self._run, name="test-canceller")
        self._thread.start()

    def cancel_soon(self, token: CancellationToken) -> None:
        self._tokens.put(token)

    def stop(self) -> None:
        self._tokens.put(None)
        self._thread.join(SOON_S)

    def _run(self) -> None:
        while (token := self._tokens.get()) is not None:
            if self._rng.random() < 0.5:
                time.sleep(self._rng.uniform(0, 0.002))
            token.cancel("cancelled by the stress test")


def claude() -> InMemoryConcurrencyLimiter:
    return create_concurrency_limiter(
        8,
        name="stress",
        workloads={
            "interactive": {"reserved": 2, "priority": 10},
            "background": {"max_concurrent": 5},
        },
    )


def assert_idle(limiter: InMemoryConcurrencyLimiter) -> None:
    stats = limiter.stats()
    assert (stats.active, stats.queued) == (0, 0), stats
    deadline = time.monotonic() + SOON_S
    while get_keeper().held() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert get_keeper().held() == 0, "a hold is still registered with the lease keeper"


def assert_limits_held_and_reached(witness: Witness) -> None:
    assert witness.most["total"] <= 8, f"{witness.most['total']} holders with max_concurrent=8"
    assert witness.most["background"] <= 5, "background went past its ceiling of 5"
    assert witness.most["total"] == 8, "the limit was never reached: the run proves nothing"
    assert witness.most["background"] == 5, "background never reached its ceiling"


def threaded_run(threads: int, uses: int, seed: int) -> tuple[Witness, Counter[str]]:
    """``threads`` threads, each using a slot ``uses`` times with random cancels
    (set from another thread) and random small run budgets."""
    limiter = claude()
    witness = Witness()
    outcomes: Counter[str] = Counter()
    outcomes_lock = threading.Lock()
    canceller = Canceller(seed)

    def worker(worker_seed: int) -> None:
        rng = random.Random(worker_seed)
        mine: Counter[str] = Counter()
        for _ in range(uses):
            workload = "interactive" if rng.random() < 0.3 else "background"
            roll = rng.random()
            cancel = None
            timeout_ms = None
            if roll < 0.1:
                cancel = CancellationToken()
                canceller.cancel_soon(cancel)
            elif roll < 0.25:
                timeout_ms = rng.choice([0.5, 1, 2, 5])
            # Some holds last long enough that every workload is at its limit at once.
            hold_s = rng.choice([0, 0, 0.0002, 0.001, 0.003, -1])
            try:
                with (
                    run(limiter=limiter, workload=workload, timeout_ms=timeout_ms, cancel=cancel),
                    slot(),
                ):
                    witness.enter(workload)
                    try:
                        if hold_s < 0:
                            witness.linger(0.05)
                        elif hold_s:
                            time.sleep(hold_s)
                    finally:
                        witness.leave(workload)
                mine["completed"] += 1
            except ConcurrencyCancelledError:
                mine["cancelled"] += 1
            except ConcurrencyTimeoutError:
                mine["timed out"] += 1
        with outcomes_lock:
            outcomes.update(mine)

    try:
        with ThreadPoolExecutor(threads) as pool:
            futures = [pool.submit(worker, seed * 1_000 + n) for n in range(threads)]
            for future in futures:
                future.result(timeout=240)
    finally:
        canceller.stop()
    assert sum(outcomes.values()) == threads * uses
    # Holds cancelled or timed out while their body ran entered it and then failed.
    assert outcomes["completed"] <= witness.entries <= threads * uses
    assert_idle(limiter)
    return witness, outcomes


def test_32_threads_with_random_cancels_and_timeouts_never_exceed_the_limit() -> None:
    witness, outcomes = threaded_run(threads=32, uses=200, seed=1)
    assert_limits_held_and_reached(witness)
    assert outcomes["completed"] > 0
    assert outcomes["cancelled"] > 0, "no cancel reached a slot: the run proves nothing"
    assert outcomes["timed out"] > 0, "no budget ran out: the run proves nothing"


@pytest.mark.stress
@pytest.mark.parametrize("seed", [2, 3])
def test_many_threads_with_random_cancels_and_timeouts_never_exceed_the_limit(
    seed: int,
) -> None:
    scale = stress_scale()
    witness, outcomes = threaded_run(threads=scale.threads, uses=scale.uses, seed=seed)
    assert_limits_held_and_reached(witness)
    assert outcomes["cancelled"] > 0
    assert outcomes["timed out"] > 0


# -- asyncio -----------------------------------------------------------------------------------


async def asyncio_run(tasks: int, uses: int, seed: int) -> tuple[Witness, Counter[str]]:
    """``tasks`` tasks using slots, randomly cancelled with ``task.cancel()``."""
    limiter = claude()
    witness = Witness()
    outcomes: Counter[str] = Counter()
    rng = random.Random(seed)

    async def agent(agent_seed: int) -> None:
        local = random.Random(agent_seed)
        for _ in range(uses):
            workload = "interactive" if local.random() < 0.3 else "background"
            timeout_ms = local.choice([1, 2, 5]) if local.random() < 0.15 else None
            try:
                async with run(limiter=limiter, workload=workload, timeout_ms=timeout_ms), slot():
                    witness.enter(workload)
                    try:
                        await asyncio.sleep(local.choice([0, 0, 0.0005, 0.002]))
                    finally:
                        witness.leave(workload)
                outcomes["completed"] += 1
            except ConcurrencyTimeoutError:
                outcomes["timed out"] += 1

    running = [asyncio.create_task(agent(seed * 1_000 + n)) for n in range(tasks)]
    # Cancel a random tenth of the agents at random moments while they run.
    for task in rng.sample(running, k=max(1, tasks // 10)):
        await asyncio.sleep(rng.uniform(0, 0.01))
        task.cancel()
    results = await asyncio.wait_for(asyncio.gather(*running, return_exceptions=True), 240)
    for result in results:
        if isinstance(result, asyncio.CancelledError):
            outcomes["cancelled"] += 1
        elif isinstance(result, BaseException):
            raise result
    assert_idle(limiter)
    return witness, outcomes


def test_asyncio_tasks_cancelled_at_random_never_exceed_the_limit() -> None:
    witness, outcomes = asyncio.run(asyncio_run(tasks=100, uses=20, seed=1))
    assert_limits_held_and_reached(witness)
    assert outcomes["cancelled"] > 0
    assert outcomes["timed out"] > 0


@pytest.mark.stress
def test_many_asyncio_tasks_cancelled_at_random_never_exceed_the_limit() -> None:
    scale = stress_scale()
    witness, outcomes = asyncio.run(asyncio_run(scale.tasks, scale.task_uses, seed=4))
    assert_limits_held_and_reached(witness)
    assert outcomes["cancelled"] > 0
