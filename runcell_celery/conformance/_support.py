"""What the conformance cases share: the case type, requests, waiting in a thread, and
checks that read a limiter's stats when it has them."""

# Test code shipped in the package: it asserts on the exceptions it catches.

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

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
    """A decorator collecting the cases it decorates, named after their function. A case
    gets ``create`` (``create_limiter``, remembering what it made), and every limiter it
    made must be idle once it returned: a case leaves no slot or queue place behind."""

    def __init__(self, create_limiter: CreateLimiter) -> None:
        super().__init__()
        self._create_limiter = create_limiter

    def __call__(self, func: Callable[[CreateLimiter], None]) -> Callable[[CreateLimiter], None]:
        def run() -> None:
            made: list[ConcurrencyLimiter] = []

            def create(**limits: Any) -> ConcurrencyLimiter:
                made.append(self._create_limiter(**limits))
                return made[-1]

            func(create)
            assert_idle(*made)

        self.append(ConformanceCase(func.__name__, run))
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


def queued(
    pool: ThreadPoolExecutor,
    limiter: ConcurrencyLimiter,
    request: AcquireRequest,
    cancel: CancellationToken | None = None,
) -> Future[Lease]:
    """Start ``limiter.acquire(request)`` in ``pool``; return once it holds its place."""
    return start_waiting(
        pool,
        lambda on_wait: limiter.acquire(request, cancel=cancel, on_wait=on_wait),
        f"{request.workload} in {limiter.name!r}",
    )


def run_threads(target: Callable[[int], None], count: int) -> None:
    """Run ``target(i)`` in ``count`` threads; raise the first error, or if one hangs."""
    pool = ThreadPoolExecutor(count, thread_name_prefix="runcell-conformance")
    try:
        futures = [pool.submit(target, i) for i in range(count)]
        deadline = time.monotonic() + 60
        for future in futures:
            try:
                future.result(max(0.0, deadline - time.monotonic()))
            except TimeoutError as exc:
                raise AssertionError("threads never finished (a deadlock?)") from exc
    finally:
        pool.shutdown(wait=False, cancel_futures=True)  # a stuck thread must not hang us


class Witness:
    """Counts the holders in flight per limiter name, as a provider would."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._now: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self.calls = 0

    @contextmanager
    def holding(self, limiters: Sequence[ConcurrencyLimiter]) -> Iterator[None]:
        """Count one call holding each of ``limiters`` for the ``with`` block."""
        with self._lock:
            self.calls += 1
            for limiter in limiters:
                now = self._now[limiter.name] = self._now.get(limiter.name, 0) + 1
                self.peak[limiter.name] = max(self.peak.get(limiter.name, 0), now)
        yield
        with self._lock:
            for limiter in limiters:
                self._now[limiter.name] -= 1


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


def assert_fresh(leases: Sequence[Lease], what: str) -> None:
    """No lease id in ``leases`` used twice; each fencing token higher than the one before."""
    ids = [lease.lease_id for lease in leases]
    assert len(set(ids)) == len(ids), f"{what}: a lease id was used twice: {ids}"
    tokens = [lease.fencing_token for lease in leases]
    assert tokens == sorted(set(tokens)), f"{what}: fencing tokens did not increase: {tokens}"
