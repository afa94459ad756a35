"""Several limiters in one slot: ``slot(openai, gpt_4o, tenants.key("acme"))``.

One request holds one slot in each limiter, granted together or not at all, and never
holds part of them while it waits. Real threads against in-memory limiters; every body
counts itself in an independent witness per limiter (what a provider would see), so a
limit exceeded anywhere fails the test whatever the limiters report.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest

import runcell_celery.memory as memory_module
from runcell_celery import (
    CancellationToken,
    ConcurrencyCancelledError,
    ConcurrencyConfigError,
    ConcurrencyLeaseLostError,
    ConcurrencyQueueFullError,
    ConcurrencyTimeoutError,
    InMemoryConcurrencyLimiter,
    Lease,
    LimiterConfig,
    create_concurrency_limiter,
    guard,
    run,
    slot,
)
from runcell_celery.allocation import GROUP_AGEING_MS
from runcell_celery.backends import MemoryBackend
from runcell_celery.conformance import members_conformance_cases
from runcell_celery.memory import Coordinator
from tests.conftest import FakeClock
from tests.core.conftest import direct_request

if TYPE_CHECKING:
    from tests.conftest import EventRecorder
    from tests.core.conftest import CustomLimiter

SOON_S = 10.0


class Witness:
    """Counts the bodies in flight per limiter name, as a provider would, and keeps the
    highest count seen."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.now: dict[str, int] = {}
        self.peak: dict[str, int] = {}

    @contextlib.contextmanager
    def inside(self, *names: str) -> Iterator[None]:
        with self._lock:
            for name in names:
                self.now[name] = self.now.get(name, 0) + 1
                self.peak[name] = max(self.peak.get(name, 0), self.now[name])
        try:
            time.sleep(random.uniform(0, 0.0005))  # let the others run meanwhile
            yield
        finally:
            with self._lock:
                for name in names:
                    self.now[name] -= 1


def run_threads(target: Callable[[int], None], count: int) -> list[BaseException]:
    """Run ``target(i)`` in ``count`` threads; fail if one does not finish in time."""
    errors: list[BaseException] = []

    def body(i: int) -> None:
        try:
            target(i)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(i,), name=f"t{i}") for i in range(count)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    stuck = [t.name for t in threads if t.is_alive()]
    assert not stuck, f"threads never finished (deadlock?): {stuck}"
    return errors


@contextlib.contextmanager
def held_directly(limiter: InMemoryConcurrencyLimiter, count: int = 1) -> Iterator[list[Lease]]:
    """Hold ``count`` slots of ``limiter`` outside the runtime meanwhile."""
    leases = [limiter.acquire(direct_request()) for _ in range(count)]
    try:
        yield leases
    finally:
        for lease in leases:
            limiter.release(lease)


def assert_idle(*limiters: InMemoryConcurrencyLimiter) -> None:
    """No slot held and nothing waiting anywhere, coordinator included."""
    for limiter in limiters:
        stats = limiter.stats()
        assert (stats.active, stats.queued) == (0, 0), (limiter.name, stats)
    for limiter in limiters:
        coordinator = limiter._root()
        with coordinator.lock:
            waiting = [w for w in coordinator.waiting if set(w.limiters) & set(limiters)]
        assert waiting == []


# -- all or nothing ------------------------------------------------------------------


def test_a_slot_over_several_limiters_holds_one_slot_in_each_while_its_block_runs(
    events: EventRecorder,
) -> None:
    openai = create_concurrency_limiter(4, name="sev-openai")
    gpt = create_concurrency_limiter(2, name="sev-gpt")
    tenants = create_concurrency_limiter(2, name="sevtenant", keyed=True)
    acme = tenants.key("acme")
    with slot(openai, gpt, acme) as held:
        inside = [x.stats().active for x in (openai, gpt, acme)]
        leases = held.leases
        tokens = held.fencing_tokens
        first = (held.lease, held.fencing_token)
    assert inside == [1, 1, 1]
    assert [lease.limiter for lease in leases] == ["sev-openai", "sev-gpt", "sevtenant:acme"]
    assert tokens == {lease.limiter: lease.fencing_token for lease in leases}
    assert first == (leases[0], leases[0].fencing_token)
    assert_idle(openai, gpt, acme)
    acquired, released = events.of("acquired")[-1], events.of("released")[-1]
    for event in (acquired, released):
        assert event.limiter == "sev-openai"
        assert event.limiters == ("sev-openai", "sev-gpt", "sevtenant:acme")
        assert event.key == "acme"
    assert acquired.lease_id == leases[0].lease_id


def test_several_limiters_are_never_over_any_limit_under_threads() -> None:
    openai = create_concurrency_limiter(3, name="aon-openai")
    gpt = create_concurrency_limiter(2, name="aon-gpt")
    tenants = create_concurrency_limiter(1, name="aontenant", keyed=True)
    witness = Witness()
    keys = ["a", "b", "c", "d"]

    def work(i: int) -> None:
        rng = random.Random(i)
        for _ in range(60):
            key = rng.choice(keys)
            tenant = tenants.key(key)
            chosen = rng.choice(
                [(openai, gpt, tenant), (openai, tenant), (gpt, openai), (tenant, gpt)]
            )
            with slot(*chosen), witness.inside(*(x.name for x in chosen)):
                pass

    assert run_threads(work, 12) == []
    assert witness.peak["aon-openai"] <= 3
    assert witness.peak["aon-gpt"] <= 2
    for key in keys:
        assert witness.peak.get(f"aontenant:{key}", 0) <= 1
    assert witness.peak["aon-openai"] >= 2, "the test never made the limiters busy"
    assert_idle(openai, gpt)
    assert tenants.keys_in_use() == 0


def test_single_and_several_limiter_requests_mixed_on_one_limiter_keep_its_limit() -> None:
    shared = create_concurrency_limiter(2, name="mix-shared")
    other = create_concurrency_limiter(2, name="mix-other")
    witness = Witness()

    def work(i: int) -> None:
        for n in range(80):
            if (i + n) % 3 == 0:
                with slot(shared, other), witness.inside("mix-shared", "mix-other"):
                    pass
            elif (i + n) % 3 == 1:
                with slot(shared), witness.inside("mix-shared"):
                    pass
            else:
                with slot(other), witness.inside("mix-other"):
                    pass

    assert run_threads(work, 10) == []
    assert witness.peak["mix-shared"] <= 2
    assert witness.peak["mix-other"] <= 2
    assert_idle(shared, other)


def test_a_request_holds_none_of_its_slots_while_it_waits_for_one() -> None:
    openai = create_concurrency_limiter(1, name="part-openai")
    gpt = create_concurrency_limiter(1, name="part-gpt")
    entered = threading.Event()
    with held_directly(gpt):
        waiting = threading.Thread(target=lambda: _enter(slot(openai, gpt), entered))
        waiting.start()
        _wait_until(lambda: gpt.stats().queued == 1, "the request waits")
        time.sleep(0.05)
        assert openai.stats().active == 0, "part of the request was held while it waited"
        assert openai.stats().queued == 1
        assert not entered.is_set()
    waiting.join(SOON_S)
    assert entered.is_set()
    assert_idle(openai, gpt)


def test_two_requests_naming_two_limiters_in_opposite_orders_never_deadlock() -> None:
    first = create_concurrency_limiter(1, name="order-first")
    second = create_concurrency_limiter(1, name="order-second")
    witness = Witness()
    done = [0]
    lock = threading.Lock()

    def work(i: int) -> None:
        pair = (first, second) if i % 2 == 0 else (second, first)
        for _ in range(125):  # 8 threads x 125 = 1,000 calls
            with slot(*pair), witness.inside("order-first", "order-second"), lock:
                done[0] += 1

    assert run_threads(work, 8) == []
    assert done[0] == 1000
    assert witness.peak == {"order-first": 1, "order-second": 1}
    assert_idle(first, second)


def test_a_request_that_lacks_room_in_one_limiter_does_not_block_the_others_behind_it() -> None:
    openai = create_concurrency_limiter(2, name="hol-openai")
    gpt = create_concurrency_limiter(1, name="hol-gpt")
    claude = create_concurrency_limiter(1, name="hol-claude")
    with held_directly(openai):
        with held_directly(gpt):
            # gpt's line: first a request for gpt alone, then one for openai and gpt.
            ahead = threading.Thread(target=lambda: _enter(slot(gpt)))
            ahead.start()
            _wait_until(lambda: gpt.stats().queued == 1, "the gpt request waits")
            blocked = threading.Thread(target=lambda: _enter(slot(openai, gpt)))
            blocked.start()
            _wait_until(lambda: openai.stats().queued == 1, "the openai+gpt request waits")
            # Behind it in openai's line, with room in both of its limiters: granted now.
            with slot(openai, claude) as behind:
                assert behind.lease is not None
                assert openai.stats().queued == 1
        for thread in (ahead, blocked):
            thread.join(SOON_S)
            assert not thread.is_alive()
    assert_idle(openai, gpt, claude)


def test_a_young_request_over_two_limiters_holds_no_room_and_an_aged_one_keeps_its_place() -> None:
    """The waiting rule (allocation, rule 4): ``[openai, gpt]`` waits on gpt; openai alone
    is granted at once. Once it has waited GROUP_AGEING_MS it is first in both lines and
    keeps openai's slot: a later request for openai alone waits behind it."""
    clock = FakeClock()
    openai = create_concurrency_limiter(1, name="ageing-openai", clock=clock)
    gpt = create_concurrency_limiter(1, name="ageing-gpt", clock=clock)
    order: list[str] = []
    with held_directly(gpt) as gpt_leases:
        both = threading.Thread(target=lambda: _record(slot(openai, gpt), "both", order))
        both.start()
        _wait_until(lambda: gpt.stats().queued == 1, "the request over both waits")
        young = openai.acquire(direct_request())  # at once: nothing is kept for it yet
        openai.release(young)
        clock.advance(GROUP_AGEING_MS / 1000)
        alone = threading.Thread(target=lambda: _record(slot(openai), "alone", order))
        alone.start()
        _wait_until(lambda: openai.stats().queued == 2, "the openai request waits")
        assert openai.stats().active == 0
        gpt.release(gpt_leases.pop())
        for thread in (both, alone):
            thread.join(SOON_S)
    assert order == ["both", "alone"]
    assert_idle(openai, gpt)


def test_a_request_over_two_limiters_is_granted_within_the_ageing_bound_under_churn() -> None:
    """The conformance case on the in-memory limiter: ``a`` alone at once, then with
    three threads churning ``a`` and ``b`` freed, ``[a, b]`` within its bound."""
    names = itertools.count()
    cases = {
        case.name: case
        for case in members_conformance_cases(
            lambda **options: create_concurrency_limiter(name=f"bound-{next(names)}", **options)
        )
    }
    cases["a_young_request_over_many_limiters_holds_no_room_and_ages_within_its_bound"].run()


def test_a_request_waiting_in_one_limiter_is_not_starved_by_requests_naming_only_the_other() -> (
    None
):
    shared = create_concurrency_limiter(1, name="starve-shared")
    other = create_concurrency_limiter(1, name="starve-other")
    stop = threading.Event()
    granted = threading.Event()

    def churn(_: int) -> None:
        while not stop.is_set():
            with slot(shared):
                time.sleep(0.001)

    churners = [threading.Thread(target=churn, args=(i,)) for i in range(4)]
    with held_directly(other) as leases:
        for thread in churners:
            thread.start()
        waiter = threading.Thread(target=lambda: _enter(slot(shared, other), granted))
        waiter.start()
        _wait_until(lambda: other.stats().queued == 1, "the request waits")
        time.sleep(0.05)
        other.release(leases[0])
        leases.clear()
        assert granted.wait(SOON_S), "the request over both limiters never got a slot"
    stop.set()
    for thread in (*churners, waiter):
        thread.join(SOON_S)
    assert_idle(shared, other)


# -- waiting ends without a slot ---------------------------------------------------------


def test_cancelling_a_request_waiting_for_several_limiters_leaves_nothing_held(
    events: EventRecorder,
) -> None:
    openai = create_concurrency_limiter(1, name="cancel-openai")
    gpt = create_concurrency_limiter(1, name="cancel-gpt")
    token = CancellationToken()
    failures: list[BaseException] = []

    def wait() -> None:
        try:
            with slot(openai, gpt, cancel=token):
                pass
        except BaseException as exc:
            failures.append(exc)

    with held_directly(gpt):
        waiting = threading.Thread(target=wait)
        waiting.start()
        started = events.wait_for("wait-started", limiter="cancel-openai")
        assert started.limiters == ("cancel-openai", "cancel-gpt")
        token.cancel("the user went away")
        waiting.join(SOON_S)
        assert [type(x) for x in failures] == [ConcurrencyCancelledError]
        assert openai.stats().active == 0
        assert gpt.stats().active == 1  # only the direct holder
        assert gpt.stats().queued == 0
    assert_idle(openai, gpt)
    cancelled = events.of("wait-cancelled", limiter="cancel-openai")
    assert [e.limiters for e in cancelled] == [("cancel-openai", "cancel-gpt")]


def test_a_request_over_several_limiters_times_out_holding_nothing(events: EventRecorder) -> None:
    openai = create_concurrency_limiter(1, name="late-openai")
    gpt = create_concurrency_limiter(1, name="late-gpt", workloads={"default": {}})
    with (
        held_directly(gpt),
        run(timeout_ms=50),
        pytest.raises(ConcurrencyTimeoutError) as failure,
        slot(openai, gpt),
    ):
        pass
    assert "late-gpt" in str(failure.value)
    assert failure.value.limiter == "late-openai"
    assert_idle(openai, gpt)
    assert [e.limiters for e in events.of("timed-out")] == [("late-openai", "late-gpt")]


def test_the_shortest_max_wait_of_the_limiters_bounds_the_wait() -> None:
    openai = create_concurrency_limiter(1, name="wait-openai")
    gpt = create_concurrency_limiter(1, name="wait-gpt", workloads={"default": {"max_wait_ms": 30}})
    started = time.monotonic()
    with held_directly(openai), pytest.raises(ConcurrencyTimeoutError), slot(openai, gpt):
        pass
    assert time.monotonic() - started < SOON_S
    assert_idle(openai, gpt)


def test_a_full_queue_in_any_limiter_refuses_the_request() -> None:
    openai = create_concurrency_limiter(1, name="qf-openai")
    gpt = create_concurrency_limiter(1, name="qf-gpt", max_queued=0)
    with held_directly(gpt), pytest.raises(ConcurrencyQueueFullError) as failure, slot(openai, gpt):
        pass
    assert failure.value.limiter == "qf-gpt"
    assert_idle(openai, gpt)


def test_an_async_request_over_several_limiters_cancelled_while_waiting_holds_nothing() -> None:
    openai = create_concurrency_limiter(1, name="async-openai")
    gpt = create_concurrency_limiter(1, name="async-gpt")

    async def main() -> None:
        async with slot(openai, gpt) as held:
            assert len(held.leases) == 2
        with held_directly(gpt):
            task = asyncio.ensure_future(slot(openai, gpt).__aenter__())
            for _ in range(500):
                await asyncio.sleep(0.002)
                if gpt.stats().queued:
                    break
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(main())
    _wait_until(lambda: gpt.stats().queued == 0, "the cancelled request left the line")
    assert_idle(openai, gpt)


# -- while held ----------------------------------------------------------------------------


def test_losing_one_lease_aborts_the_hold_and_releases_the_others(events: EventRecorder) -> None:
    openai = create_concurrency_limiter(2, name="lost-openai", lease_ttl_ms=300)
    gpt = create_concurrency_limiter(2, name="lost-gpt", lease_ttl_ms=300)
    aborted = threading.Event()
    seen: dict[str, Any] = {}

    def hold() -> None:
        with slot(openai, gpt) as held:
            held.on_abort(aborted.set)
            gpt.release(held.leases[1])  # as a force-release by an operator would
            assert aborted.wait(SOON_S)
            seen["openai"] = openai.stats().active
            seen["aborted"] = held.aborted

    with pytest.raises(ConcurrencyLeaseLostError) as failure:
        hold()
    assert seen == {"openai": 0, "aborted": True}
    assert "lost-gpt" in str(failure.value)
    lost = events.of("lease-lost")
    assert [(e.limiters, e.reason) for e in lost] == [(("lost-openai", "lost-gpt"), "renewal")]
    assert_idle(openai, gpt)


def test_every_lease_of_several_is_renewed_while_the_block_runs() -> None:
    openai = create_concurrency_limiter(1, name="renew-openai", lease_ttl_ms=150)
    gpt = create_concurrency_limiter(1, name="renew-gpt", lease_ttl_ms=150)
    with slot(openai, gpt) as held:
        time.sleep(0.5)  # three TTLs: unrenewed, both leases would have expired
        assert (openai.stats().active, gpt.stats().active) == (1, 1)
        assert not held.aborted
    assert_idle(openai, gpt)


def test_max_hold_of_any_limiter_ends_the_hold_and_frees_every_slot() -> None:
    openai = create_concurrency_limiter(1, name="mh-openai")
    gpt = create_concurrency_limiter(1, name="mh-gpt", max_hold_ms=100)
    aborted = threading.Event()

    def hold() -> None:
        with slot(openai, gpt) as held:
            held.on_abort(aborted.set)
            assert aborted.wait(SOON_S)
            _wait_until(lambda: openai.stats().active == 0, "max-hold freed the openai slot")

    with pytest.raises(ConcurrencyLeaseLostError):
        hold()
    assert_idle(openai, gpt)


# -- what may not be held together ---------------------------------------------------------


def test_a_keyed_limiter_itself_is_refused_naming_its_keys() -> None:
    openai = create_concurrency_limiter(1, name="kd-openai")
    tenants = create_concurrency_limiter(2, name="kdtenant", keyed=True)
    for make in (lambda: slot(openai, tenants), lambda: slot(tenants)):
        with pytest.raises(ConcurrencyConfigError, match=r"kdtenant\.key\("), make():
            pass
    with pytest.raises(ConcurrencyConfigError, match=r"kdtenant\.key\("):
        tenants.acquire(direct_request())
    with pytest.raises(ConcurrencyConfigError, match=r"kdtenant\.key\("):
        run(limiter=[openai, tenants]).__enter__()
    assert_idle(openai)


def test_the_same_limiter_twice_is_refused() -> None:
    openai = create_concurrency_limiter(1, name="twice-openai")
    with pytest.raises(ConcurrencyConfigError, match="named twice"), slot(openai, openai):
        pass
    assert_idle(openai)


def test_limiters_of_different_backends_cannot_be_held_together(
    custom_limiter: Callable[..., CustomLimiter], events: EventRecorder
) -> None:
    openai = create_concurrency_limiter(1, name="mixed-openai")
    custom = custom_limiter(1)
    with (
        pytest.raises(ConcurrencyConfigError, match="cannot be held together") as failure,
        slot(openai, custom),
    ):
        pass
    assert "mixed-openai" in str(failure.value)
    assert custom.name in str(failure.value)
    assert custom.requests == []
    assert_idle(openai)
    refused = events.of("config-error")
    assert [e.limiters for e in refused] == [("mixed-openai", custom.name)]


def test_a_workload_none_of_the_limiters_has_is_refused_and_one_some_have_applies_there() -> None:
    openai = create_concurrency_limiter(2, name="wl-openai")
    gpt = create_concurrency_limiter(
        2, name="wl-gpt", workloads={"batch": {"max_concurrent": 1}, "default": {}}
    )
    with (
        pytest.raises(ConcurrencyConfigError, match="exists in none"),
        slot(openai, gpt, workload="bacth"),
    ):
        pass
    with slot(openai, gpt, workload="batch") as held:
        assert [lease.workload for lease in held.leases] == ["default", "batch"]
        assert gpt.stats().workloads["batch"].active == 1
    assert_idle(openai, gpt)


# -- runs and guard ------------------------------------------------------------------------


def test_a_run_of_several_limiters_gives_every_slot_all_of_them_and_children_inherit() -> None:
    openai = create_concurrency_limiter(2, name="run-openai")
    tenants = create_concurrency_limiter(2, name="runtenant", keyed=True)
    acme = tenants.key("acme")
    with run(limiter=[openai, acme], key="acme-key") as parent:
        assert parent.limiters == (openai, acme)
        assert parent.limiter is openai
        assert parent.key == "acme-key"
        with slot() as held:
            assert [x.limiter for x in held.leases] == ["run-openai", "runtenant:acme"]
            assert held.leases[0].request_id == held.leases[1].request_id
        with run() as child, slot() as inner:
            assert child.limiters == (openai, acme)
            assert child.key == "acme-key"
            assert len(inner.leases) == 2
    with run(limiter=openai) as single:
        assert single.limiters == (openai,)
    with run() as none:
        assert (none.limiter, none.limiters) == (None, ())
    assert_idle(openai, acme)


def test_guard_holds_a_slot_in_each_of_several_limiters_per_call() -> None:
    openai = create_concurrency_limiter(1, name="guard-openai")
    gpt = create_concurrency_limiter(1, name="guard-gpt")

    @guard(limiter=[openai, gpt])
    def call() -> tuple[int, int]:
        return openai.stats().active, gpt.stats().active

    assert call() == (1, 1)
    assert_idle(openai, gpt)


# -- helpers ---------------------------------------------------------------------------------


def _enter(held: Any, entered: threading.Event | None = None) -> None:
    with held:
        if entered is not None:
            entered.set()


def _record(held: Any, name: str, order: list[str]) -> None:
    with held:
        order.append(name)


def _wait_until(check: Callable[[], object], what: str) -> None:
    deadline = time.monotonic() + SOON_S
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(0.002)


def test_a_slot_on_one_of_the_runs_limiters_uses_the_runs_workload_where_it_exists() -> None:
    openai = create_concurrency_limiter(2, name="one-openai")
    gpt = create_concurrency_limiter(2, name="one-gpt", workloads={"batch": {}, "default": {}})
    with run(limiter=[openai, gpt], workload="batch"):
        with slot(gpt) as on_gpt:
            assert on_gpt.lease is not None
            assert on_gpt.lease.workload == "batch"
        with slot(openai) as on_openai:
            assert on_openai.lease is not None
            assert on_openai.lease.workload == "default"
    assert_idle(openai, gpt)


def test_async_requests_over_several_limiters_wait_without_a_thread_each() -> None:
    openai = create_concurrency_limiter(1, name="aw-openai")
    gpt = create_concurrency_limiter(2, name="aw-gpt")
    inside = [0]
    peak = [0]

    async def call() -> None:
        async with slot(openai, gpt):
            inside[0] += 1
            peak[0] = max(peak[0], inside[0])
            await asyncio.sleep(0.001)
            inside[0] -= 1

    async def main() -> int:
        with held_directly(openai):
            tasks = [asyncio.ensure_future(call()) for _ in range(50)]
            for _ in range(1000):
                await asyncio.sleep(0.002)
                if openai.stats().queued == 50:
                    break
            assert openai.stats().queued == 50
            threads_while_waiting = threading.active_count()
        await asyncio.gather(*tasks)
        return threads_while_waiting

    threads_before = threading.active_count()
    threads_while_waiting = asyncio.run(main())
    assert threads_while_waiting <= threads_before + 2
    assert peak[0] == 1
    assert_idle(openai, gpt)


def test_the_memory_backend_owns_the_coordinator_its_limiters_wait_in() -> None:
    """No process-wide coordinator: the backend's limiters share the backend's, and two
    limiters made apart merge theirs when one request names both."""
    backend = MemoryBackend()
    a = backend.create_limiter(LimiterConfig(name="owned-a", max_concurrent=1))
    b = backend.create_limiter(LimiterConfig(name="owned-b", max_concurrent=1))
    assert isinstance(a, InMemoryConcurrencyLimiter)
    assert isinstance(b, InMemoryConcurrencyLimiter)
    assert a._coordinator is b._coordinator is backend._coordinator
    with slot(a, b) as held:
        assert [lease.limiter for lease in held.leases] == ["owned-a", "owned-b"]
    apart = create_concurrency_limiter(1, name="made-apart")
    assert apart._root() is not a._root()
    with slot(a, apart):
        assert apart._root() is a._root()
    assert not any(isinstance(value, Coordinator) for value in vars(memory_module).values())
    assert_idle(a, b, apart)
