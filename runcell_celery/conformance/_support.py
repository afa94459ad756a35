"""What the conformance cases share: the case type, requests, waiting in a thread, and
checks that read a limiter's stats when it has them."""

# Test code shipped in the package: it asserts on the exceptions it catches.

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from ..cancellation import CancellationToken
from ..errors import ConcurrencyTimeoutError
from ..ids import new_request_id
from ..protocol import (
    AcquireRequest,
    ConcurrencyLimiter,
    Lease,
    LimiterStats,
    OnWait,
    RunLineage,
    SupportsStats,
)

CreateLimiter = Callable[..., ConcurrencyLimiter]
T = TypeVar("T")
E = TypeVar("E", bound=BaseException)

#: Upper bound for anything that should happen "soon" (a wake-up, an expiry poll).
SOON_S = 10.0
#: The budget of a request that must wait, so a case that fails ends instead of hanging.
WAIT_MS = SOON_S * 1000


@dataclass(frozen=True)
class ConformanceCase:
    """One behaviour a limiter must have; ``run()`` raises ``AssertionError`` if not."""

    name: str
    run: Callable[[], None]


class Cases(list[ConformanceCase]):
    """A decorator collecting the cases it decorates, named after their function."""

    def __call__(self, func: Callable[[], None]) -> Callable[[], None]:
        self.append(ConformanceCase(func.__name__, func))
        return func


def new_requests(workloads: Sequence[str], timeout_ms: float | None = None) -> list[AcquireRequest]:
    """One request's members: one id, run and budget, a workload per limiter."""
    request_id = new_request_id()
    lineage = RunLineage(run_id=request_id, root_run_id=request_id)
    return [
        AcquireRequest(request_id=request_id, workload=w, lineage=lineage, timeout_ms=timeout_ms)
        for w in workloads
    ]


def new_request(workload: str = "default", timeout_ms: float | None = None) -> AcquireRequest:
    return new_requests([workload], timeout_ms)[0]


def raises(error: type[E], why: str, call: Callable[..., object], *args: object) -> E:
    """The ``error`` ``call(*args)`` raises; ``AssertionError(why)`` if it returns."""
    try:
        call(*args)
    except error as exc:
        return exc
    raise AssertionError(why)


def stats_of(limiter: ConcurrencyLimiter) -> LimiterStats | None:
    return limiter.stats() if isinstance(limiter, SupportsStats) else None


def assert_idle(*limiters: ConcurrencyLimiter) -> None:
    for limiter in limiters:
        stats = stats_of(limiter)
        if stats is not None:
            assert (stats.active, stats.queued) == (0, 0), (
                f"expected {limiter.name!r} idle, got {stats}"
            )


def start_waiting(pool: ThreadPoolExecutor, acquire: Callable[[OnWait], T], what: str) -> Future[T]:
    """Run ``acquire(on_wait)`` in ``pool``; return once it waits (``on_wait`` called)."""
    queued = threading.Event()
    future = pool.submit(acquire, lambda _deadline: queued.set())
    if not queued.wait(SOON_S):
        if future.done():
            raise AssertionError(f"expected {what} to wait, got {future.result()}")
        raise AssertionError(f"{what} neither waited nor returned")
    return future


class Queued:
    """Start an ``acquire`` in a thread and know once it holds its place in the queue."""

    def __init__(
        self,
        pool: ThreadPoolExecutor,
        limiter: ConcurrencyLimiter,
        request: AcquireRequest,
        cancel: CancellationToken | None = None,
    ) -> None:
        self.request = request
        self.future: Future[Lease] = start_waiting(
            pool,
            lambda on_wait: limiter.acquire(request, cancel=cancel, on_wait=on_wait),
            f"{request.workload} in {limiter.name!r}",
        )

    def lease(self) -> Lease:
        return self.future.result(SOON_S)


def assert_times_out(
    limiter: ConcurrencyLimiter, why: str, workload: str = "default", timeout_ms: float = 50
) -> None:
    try:
        lease = limiter.acquire(new_request(workload, timeout_ms=timeout_ms))
    except ConcurrencyTimeoutError as exc:
        assert exc.limiter == limiter.name, f"the timeout names {exc.limiter!r}"
    else:
        limiter.release(lease)
        raise AssertionError(f"{limiter.name!r} granted a slot although {why}")
