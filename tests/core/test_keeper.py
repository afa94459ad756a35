"""The lease keeper: one named loop per process renews held leases, batched per limiter."""

from __future__ import annotations

import multiprocessing
import threading
import time
from collections.abc import Mapping, Sequence

from runcell_celery import (
    InMemoryConcurrencyLimiter,
    Lease,
    LimiterConfig,
    create_concurrency_limiter,
    slot,
)
from runcell_celery.keeper import get_keeper
from runcell_celery.protocol import SupportsRenewMany, supports

SOON_S = 10.0


class CountingLimiter(InMemoryConcurrencyLimiter):
    """An in-memory limiter that counts its batched renewals."""

    def __init__(self, config: LimiterConfig) -> None:
        super().__init__(config)
        self.batches: list[int] = []

    def renew_many(self, leases: Sequence[Lease]) -> Mapping[str, Lease | None]:
        self.batches.append(len(leases))
        return super().renew_many(leases)


def test_the_keeper_runs_in_one_named_thread_for_every_lease() -> None:
    # Other tests' PostgreSQL backends may still run keepers of their own (one per
    # backend and process): count only the keeper threads this test's slots start.
    def keepers() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name == "runcell-lease-keeper"}

    before = keepers()
    limiter = create_concurrency_limiter(3)
    with slot(limiter), slot(limiter), slot(limiter):
        started = keepers() - before
        running = keepers()
    assert len(started) <= 1, f"{len(started)} keeper threads for three leases"
    assert running, "no keeper thread renews the leases"


def test_leases_of_a_limiter_that_renews_many_are_renewed_in_one_call() -> None:
    counting = CountingLimiter(create_concurrency_limiter(2, lease_ttl_ms=300).config)
    assert supports(counting, SupportsRenewMany)
    with slot(counting), slot(counting):
        deadline = time.monotonic() + SOON_S
        while not counting.batches and time.monotonic() < deadline:
            time.sleep(0.01)
    assert counting.batches
    assert counting.batches[0] == 2


def _child_keeper(parent_keeper_id: int, answers: multiprocessing.SimpleQueue[object]) -> None:
    keeper = get_keeper()
    answers.put((id(keeper) != parent_keeper_id, keeper.held()))


def test_a_forked_child_gets_a_keeper_of_its_own() -> None:
    context = multiprocessing.get_context("fork")
    answers: multiprocessing.SimpleQueue[object] = context.SimpleQueue()
    with slot(create_concurrency_limiter(1)):
        parent = get_keeper()
        child = context.Process(target=_child_keeper, args=(id(parent), answers))
        child.start()
        child.join(SOON_S)
    assert child.exitcode == 0
    assert answers.get() == (True, 0)
