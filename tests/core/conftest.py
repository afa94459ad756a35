"""Fixtures for the slot runtime tests: a custom limiter whose storage can fail.

The runtime is what these tests exercise; the limiter under it is a real in-memory
limiter wrapped the way any custom limiter may be (the protocol allows it), so a
test can make renewals answer "gone" or raise, or make a release or an acquire fail,
as a database would.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Literal

import pytest

from runcell_celery import (
    AcquireRequest,
    CancellationToken,
    InMemoryConcurrencyLimiter,
    Lease,
    LimiterConfig,
    LimiterStats,
    RunLineage,
    create_concurrency_limiter,
)
from runcell_celery.keeper import get_keeper
from runcell_celery.protocol import OnWait, Outcome

RenewMode = Literal["renew", "lost", "fail"]


class CustomLimiter:
    """A custom limiter: a real in-memory limiter behind a storage that may fail.

    It has no ``acquire_async`` or ``renew_many``, so the runtime uses its blocking
    ``acquire`` from a worker thread and renews its leases one by one.
    """

    def __init__(self, inner: InMemoryConcurrencyLimiter) -> None:
        self.inner = inner
        self.renew_mode: RenewMode = "renew"
        self.renew_error: BaseException = OSError("the limiter's database is unreachable")
        self.renew_failures_left: int | None = None  # None: fail for as long as set
        self.release_error: BaseException | None = None
        self.acquire_error: BaseException | None = None
        self.requests: list[AcquireRequest] = []
        self.released: list[tuple[str, Outcome]] = []
        self.renewals = 0
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def config(self) -> LimiterConfig:
        return self.inner.config

    def validate_workload(self, workload: str | None) -> str:
        return self.inner.validate_workload(workload)

    def acquire(
        self,
        request: AcquireRequest,
        *,
        cancel: CancellationToken | None = None,
        on_wait: OnWait | None = None,
    ) -> Lease:
        with self._lock:
            self.requests.append(request)
        if self.acquire_error is not None:
            raise self.acquire_error
        return self.inner.acquire(request, cancel=cancel, on_wait=on_wait)

    def renew(self, lease: Lease) -> Lease | None:
        with self._lock:
            self.renewals += 1
            mode = self.renew_mode
            if mode == "fail" and self.renew_failures_left is not None:
                self.renew_failures_left -= 1
                if self.renew_failures_left <= 0:
                    self.renew_mode = "renew"
        if mode == "lost":
            return None
        if mode == "fail":
            raise self.renew_error
        return self.inner.renew(lease)

    def release(self, lease: Lease, outcome: Outcome = "success") -> None:
        with self._lock:
            self.released.append((lease.lease_id, outcome))
        if self.release_error is not None:
            raise self.release_error
        self.inner.release(lease, outcome)

    def stats(self) -> LimiterStats:
        return self.inner.stats()


_names = itertools.count(1)
_requests = itertools.count(1)


def direct_request(workload: str = "default", timeout_ms: float | None = None) -> AcquireRequest:
    """A request made straight to a limiter, bypassing the slot runtime."""
    number = next(_requests)
    return AcquireRequest(
        request_id=f"direct-{number}",
        workload=workload,
        lineage=RunLineage(f"direct-{number}", f"direct-{number}"),
        timeout_ms=timeout_ms,
    )


@contextlib.contextmanager
def _full(limiter: Any, workload: str = "default") -> Iterator[list[Lease]]:
    size = limiter.config.max_concurrent
    leases = [limiter.acquire(direct_request(workload)) for _ in range(size)]
    try:
        yield leases
    finally:
        for lease in leases:
            limiter.release(lease)


@pytest.fixture
def limiter_full() -> Callable[..., contextlib.AbstractContextManager[list[Lease]]]:
    """``with limiter_full(limiter):`` holds every slot (bypassing the runtime) meanwhile."""
    return _full


@pytest.fixture
def custom_limiter() -> Callable[..., CustomLimiter]:
    """``custom_limiter(max_concurrent, **options)``: a fresh, uniquely named one."""

    def create(max_concurrent: int = 1, **options: Any) -> CustomLimiter:
        options.setdefault("name", f"custom-{next(_names)}")
        return CustomLimiter(create_concurrency_limiter(max_concurrent, **options))

    return create


@pytest.fixture
def limiter_name() -> str:
    """A limiter name no other test uses, so events can be told apart."""
    return f"limiter-{next(_names)}"


@pytest.fixture(autouse=True)
def _no_hold_outlives_its_test() -> Iterator[None]:
    """Fail a test that leaves a slot registered with the process's lease keeper."""
    yield
    keeper = get_keeper()
    deadline = time.monotonic() + 2.0
    while keeper.held() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert keeper.held() == 0, "a slot was still held after the test"
