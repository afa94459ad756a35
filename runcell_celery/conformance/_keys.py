"""The cases of a backend with keys
(:func:`~runcell_celery.conformance.keyed_conformance_cases`)."""

# Test code shipped in the package: it asserts on the exceptions it catches.

from __future__ import annotations

import gc
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol, runtime_checkable

from ..errors import ConcurrencyConfigError, ConcurrencyTimeoutError
from ..protocol import ConcurrencyLimiter, KeyStats, Lease, LimiterStats, SupportsKeys
from ..slot import slot
from ._support import (
    SOON_S,
    WAIT_MS,
    Cases,
    ConformanceCase,
    CreateLimiter,
    assert_fresh,
    assert_idle,
    assert_times_out,
    new_request,
    queued,
    raises,
)


@runtime_checkable
class Keyed(ConcurrencyLimiter, SupportsKeys, Protocol):
    """A keyed limiter: refuses slots itself, ``key(k)`` is the limiter of key ``k``."""


@runtime_checkable
class ReportsKeys(Protocol):
    """What a keyed limiter tells operators about its keys (both built-in ones do)."""

    def key_stats(self, limit: int | None = ...) -> Sequence[KeyStats]: ...

    def keys_in_use(self) -> int: ...

    def stats(self, *, per_key: bool = ...) -> LimiterStats: ...


@runtime_checkable
class PurgesIdleKeys(Protocol):
    """Deletes its idle keys on demand (the PostgreSQL one; others forget them)."""

    def purge_idle_keys(self) -> int: ...


def keyed_limiter(create: CreateLimiter, **limits: Any) -> Keyed:
    limiter = create(keyed=True, **limits)
    assert isinstance(limiter, Keyed), (
        f"create_limiter(keyed=True, ...) made {limiter!r}, which has no key(): "
        "a limiter without keys does not run the keyed cases"
    )
    return limiter


def reports_keys(keyed: Keyed) -> ReportsKeys:
    assert isinstance(keyed, ReportsKeys), (
        f"keyed limiter {keyed.name!r} must report its keys: key_stats(limit), "
        "keys_in_use() and stats(per_key=True)"
    )
    return keyed


def assert_no_key_in_use(keyed: Keyed) -> None:
    assert_idle(keyed)
    if isinstance(keyed, ReportsKeys):
        assert keyed.keys_in_use() == 0, f"{keyed.keys_in_use()} keys still in use"
        assert list(keyed.key_stats()) == [], f"idle keys listed: {keyed.key_stats()}"


def assert_slot_refused(keyed: Keyed, *others: ConcurrencyLimiter) -> None:
    """``slot()`` over the keyed limiter itself (after ``others``) fails, naming it."""
    try:
        with slot(*others, keyed):
            raise AssertionError(f"slot() entered on the keyed limiter {keyed.name!r} itself")
    except ConcurrencyConfigError as exc:
        assert keyed.name in str(exc), f"the error does not name the limiter: {exc}"


def keyed_conformance_cases(create_limiter: CreateLimiter) -> list[ConformanceCase]:
    """The cases of a backend with keys: ``create_limiter(keyed=True, ...)`` returns a
    :class:`~runcell_celery.protocol.SupportsKeys` that reports ``key_stats(limit)``,
    ``keys_in_use()`` and ``stats(per_key=True)``."""
    case = cases = Cases(create_limiter)

    @case
    def each_key_has_its_own_limit(create: CreateLimiter) -> None:
        keyed = keyed_limiter(create, max_concurrent=2)
        acme, globex = keyed.key("acme"), keyed.key("globex")
        held = [acme.acquire(new_request()) for _ in range(2)]
        try:
            others = [globex.acquire(new_request(timeout_ms=WAIT_MS)) for _ in range(2)]
        except ConcurrencyTimeoutError as exc:
            raise AssertionError("a key at its limit blocked another key") from exc
        assert_times_out(acme, "the key holds its 2 slots")
        assert_times_out(globex, "the key holds its 2 slots")
        for lease in held:
            acme.release(lease)
        for lease in others:
            globex.release(lease)
        assert_idle(acme, globex)
        assert_no_key_in_use(keyed)

    @case
    def a_keys_limiter_is_named_after_the_limiter_and_the_key(create: CreateLimiter) -> None:
        keyed = keyed_limiter(create, max_concurrent=1)
        for key in ("acme", "Globex Corp.", "tenant:42", "Ünïcödé", "k" * 128):
            limiter = keyed.key(key)
            assert limiter.name == f"{keyed.name}:{key}", f"key {key!r} named {limiter.name!r}"
            lease = limiter.acquire(new_request(timeout_ms=WAIT_MS))
            assert lease.limiter == limiter.name, f"{key!r}: the lease names {lease.limiter!r}"
            limiter.release(lease)
        assert_no_key_in_use(keyed)

    @case
    def the_keyed_limiter_itself_refuses_a_slot(create: CreateLimiter) -> None:
        keyed = keyed_limiter(create, max_concurrent=1)
        asked = new_request(timeout_ms=50)
        why = "the keyed limiter itself granted a slot"
        exc = raises(ConcurrencyConfigError, why, lambda: keyed.release(keyed.acquire(asked)))
        assert exc.limiter == keyed.name, f"the error names {exc.limiter!r}"
        assert_slot_refused(keyed)
        assert_no_key_in_use(keyed)

    @case
    def invalid_keys_are_refused_naming_the_key(create: CreateLimiter) -> None:
        keyed = keyed_limiter(create, max_concurrent=1)
        for bad in ["", "   ", "x" * 129, "line\nbreak", "bell\a", 42, None]:
            exc = raises(ConcurrencyConfigError, f"key {bad!r} was accepted", keyed.key, bad)
            assert repr(bad) in str(exc), f"the error does not name key {bad!r}: {exc}"
        assert_no_key_in_use(keyed)

    @case
    def fencing_tokens_of_a_key_increase_across_uses(create: CreateLimiter) -> None:
        keyed = keyed_limiter(create, max_concurrent=1)
        leases: list[Lease] = []
        for _ in range(3):
            for _ in range(3):
                limiter = keyed.key("acme")
                leases.append(limiter.acquire(new_request(timeout_ms=WAIT_MS)))
                limiter.release(leases[-1])
                del limiter
            # Idle now: the key may be forgotten, or purged, before its next use; its
            # tokens must still go on increasing (a proxy remembers the highest seen).
            gc.collect()
            if isinstance(keyed, PurgesIdleKeys):
                keyed.purge_idle_keys()
        assert_fresh(leases, "key 'acme'")
        assert_no_key_in_use(keyed)

    @case
    def key_stats_list_the_keys_in_use_busiest_first(create: CreateLimiter) -> None:
        keyed = keyed_limiter(create, max_concurrent=2)
        reports = reports_keys(keyed)
        used_once = keyed.key("used-once")
        used_once.release(used_once.acquire(new_request()))
        acme, globex, hooli = keyed.key("acme"), keyed.key("globex"), keyed.key("hooli")
        held = [(acme, acme.acquire(new_request())) for _ in range(2)]
        held += [(hooli, hooli.acquire(new_request())) for _ in range(2)]
        held.append((globex, globex.acquire(new_request())))
        with ThreadPoolExecutor(1) as pool:
            waiting = queued(pool, acme, new_request(timeout_ms=WAIT_MS))
            expected = [KeyStats("acme", 2, 1), KeyStats("hooli", 2, 0), KeyStats("globex", 1, 0)]
            assert list(reports.key_stats()) == expected, f"got {reports.key_stats()}"
            assert list(reports.key_stats(1)) == expected[:1], f"got {reports.key_stats(1)}"
            totals = reports.stats(per_key=True)
            assert list(totals.keys) == expected, f"stats(per_key=True).keys: {totals.keys}"
            assert (totals.active, totals.queued) == (5, 1), f"totals over the keys: {totals}"
            assert reports.keys_in_use() == 3, f"{reports.keys_in_use()} keys in use, not 3"
            for limiter, lease in held:
                limiter.release(lease)
            acme.release(waiting.result(SOON_S))
        assert_idle(acme, globex, hooli)
        assert_no_key_in_use(keyed)

    @case
    def keys_in_use_go_back_to_zero_once_idle(create: CreateLimiter) -> None:
        keyed = keyed_limiter(create, max_concurrent=1)
        reports = reports_keys(keyed)
        assert reports.keys_in_use() == 0, "a new keyed limiter has keys in use"
        limiters = [keyed.key(f"tenant-{i}") for i in range(3)]
        held = [limiter.acquire(new_request()) for limiter in limiters]
        assert reports.keys_in_use() == 3
        with ThreadPoolExecutor(1) as pool:
            waiting = queued(pool, limiters[0], new_request(timeout_ms=WAIT_MS))
            assert reports.keys_in_use() == 3, "a waiting request counted as another key"
            for limiter, lease in zip(limiters[1:], held[1:], strict=True):
                limiter.release(lease)
            assert reports.keys_in_use() == 1, f"{reports.keys_in_use()} keys in use, not 1"
            limiters[0].release(held[0])
            lease = waiting.result(SOON_S)
            assert reports.keys_in_use() == 1, "the key holding a slot is not in use"
            limiters[0].release(lease)
        assert reports.keys_in_use() == 0, f"{reports.keys_in_use()} keys in use once idle"
        assert list(reports.stats(per_key=True).keys) == [], "idle keys listed per key"
        assert_no_key_in_use(keyed)

    return list(cases)
