"""The engine under the faults that used to take a limiter down.

A process frozen while it holds the limiter row, a process frozen between its grant
and its body, holders frozen in their bodies past their leases, ten thousand grants in
one transaction, and a thousand ``async with`` waiters on one event loop whose holders
do their own I/O.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import psycopg
import pytest

from runcell_celery import (
    ConcurrencyLeaseLostError,
    ConcurrencyTimeoutError,
    add_event_listener,
    run,
    slot,
)
from runcell_celery.postgres import create_postgres_concurrency_limiter
from tests.conftest import EventRecorder, wait_until
from tests.support.pg import unique_name

SPAWN = multiprocessing.get_context("spawn")


class Witness:
    """Counts bodies in flight in this process, independently of the limiter."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.now = 0
        self.most = 0
        self.total = 0

    def enter(self) -> None:
        with self._lock:
            self.now += 1
            self.total += 1
            self.most = max(self.most, self.now)

    def leave(self) -> None:
        with self._lock:
            self.now -= 1


def freeze_holding_the_limiter_row(dsn: str, name: str, ready: Connection) -> None:
    """Lock the limiter row the way a multi-statement transaction of ours does (with
    our bounds), say so, then stand still until stopped or killed."""
    conn = psycopg.connect(dsn)
    conn.execute("SET LOCAL idle_in_transaction_session_timeout = 3000")
    conn.execute("SELECT 1 FROM runcell_limiter WHERE name = %s FOR UPDATE", [name])
    ready.send("locked")
    while True:
        time.sleep(1)


def wait_for_a_slot(dsn: str, limits: dict[str, Any], report: Connection) -> None:
    """Wait for a slot; report whether the body started or the lease was lost."""
    limiter = create_postgres_concurrency_limiter(dsn, **limits)
    # The grant must reach it by notification while it is stopped. Were it queued before
    # its listener had connected, the grant would be missed, and the safety poll would
    # find the request gone (its lease expired and was taken) and rightly queue it again
    # behind the next holder: a different story from the one told here.
    deadline = time.monotonic() + 30
    while limiter.listening is not True:
        if limiter.listening is False or time.monotonic() > deadline:
            report.send("failed: the listener never connected")
            return
        time.sleep(0.01)
    report.send("waiting")
    try:
        with slot(limiter):
            report.send("body-started")
    except ConcurrencyLeaseLostError as exc:
        report.send(f"lease-lost: {exc}")
    except Exception as exc:
        report.send(f"failed: {type(exc).__name__}: {exc}")


@pytest.fixture
def stopped_processes() -> Iterator[list[Any]]:
    started: list[Any] = []
    yield started
    for process in started:
        if process.is_alive():
            os.kill(process.pid, signal.SIGKILL)
        process.join(10)


def _queued(dsn: str, name: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM runcell_queue WHERE limiter = %s", [name]
        ).fetchone()
    assert row is not None
    return int(row[0])


def test_a_frozen_process_holding_the_limiter_row_delays_others_only_by_their_own_wait(
    pg_dsn: str, stopped_processes: list[Any]
) -> None:
    name = unique_name("frozen-lock")
    limiter = create_postgres_concurrency_limiter(pg_dsn, name=name, max_concurrent=2)
    witness = Witness()
    parent, child = SPAWN.Pipe()
    frozen = SPAWN.Process(target=freeze_holding_the_limiter_row, args=(pg_dsn, name, child))
    frozen.start()
    stopped_processes.append(frozen)
    assert parent.poll(30)
    assert parent.recv() == "locked"
    os.kill(frozen.pid, signal.SIGSTOP)  # frozen with the row locked

    timed_out: list[float] = []
    served: list[float] = []
    errors: list[BaseException] = []

    def with_one_second() -> None:
        started = time.monotonic()
        try:
            with run(timeout_ms=1_000), slot(limiter):
                witness.enter()
                witness.leave()
        except ConcurrencyTimeoutError:
            timed_out.append(time.monotonic() - started)
        except BaseException as exc:
            errors.append(exc)

    def without_deadline() -> None:
        started = time.monotonic()
        try:
            with slot(limiter):
                witness.enter()
                time.sleep(0.05)
                witness.leave()
            served.append(time.monotonic() - started)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=with_one_second) for _ in range(4)]
    threads += [threading.Thread(target=without_deadline) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert errors == []
    assert len(timed_out) == 4, "every 1 s wait ended with a timeout"
    assert max(timed_out) < 1.5, f"a 1 s wait lasted {max(timed_out):.2f} s"
    # The server ends the frozen transaction (idle_in_transaction_session_timeout,
    # 3 s); then every request without a deadline is served.
    assert len(served) == 4
    assert witness.most <= 2, f"{witness.most} bodies ran at once with a limit of 2"


def test_a_process_paused_between_its_grant_and_its_body_never_starts_the_body(
    pg_dsn: str, stopped_processes: list[Any]
) -> None:
    name = unique_name("paused-grant")
    limits = {"name": name, "max_concurrent": 1, "lease_ttl_ms": 1_500}
    limiter = create_postgres_concurrency_limiter(pg_dsn, **limits)
    witness = Witness()
    held = slot(limiter)
    held.__enter__()
    parent, child = SPAWN.Pipe()
    waiter = SPAWN.Process(target=wait_for_a_slot, args=(pg_dsn, limits, child))
    waiter.start()
    stopped_processes.append(waiter)
    assert parent.poll(30)
    assert parent.recv() == "waiting"
    deadline = time.monotonic() + 30
    while _queued(pg_dsn, name) == 0:
        assert time.monotonic() < deadline, "the other process never queued"
        time.sleep(0.02)
    os.kill(waiter.pid, signal.SIGSTOP)
    held.__exit__(None, None, None)  # the slot is granted to the stopped process

    # Its lease expires while it is stopped; the slot comes back to the next waiter.
    after_pause = threading.Event()

    def next_holder() -> None:
        with slot(limiter):
            witness.enter()
            after_pause.wait(30)
            witness.leave()

    taker = threading.Thread(target=next_holder)
    taker.start()
    deadline = time.monotonic() + 20
    while witness.total == 0:
        assert time.monotonic() < deadline, "the expired grant never came back"
        time.sleep(0.05)
    os.kill(waiter.pid, signal.SIGCONT)
    assert parent.poll(20), "the paused process said nothing after it resumed"
    said = parent.recv()
    after_pause.set()
    taker.join(30)
    assert said.startswith("lease-lost"), said
    assert "expired before its body could start" in said
    assert witness.most == 1


@pytest.mark.stress  # 10,000 waiters (about 12 s); CI runs the stress suite too
def test_ten_thousand_grants_at_once_are_all_served_and_the_limiter_keeps_working(
    pg_dsn: str,
) -> None:
    waiters = 10_000
    name = unique_name("mass-grant")
    limiter = create_postgres_concurrency_limiter(
        pg_dsn, name=name, max_concurrent=1, pool_max_size=8
    )
    served = 0
    tokens: set[int] = set()

    async def one(all_queued: asyncio.Event) -> None:
        nonlocal served
        await all_queued.wait()
        async with slot(limiter) as held:
            assert held.fencing_token is not None
            tokens.add(held.fencing_token)
            served += 1

    async def main() -> None:
        started = asyncio.Event()
        held = slot(limiter)
        await held.__aenter__()  # nobody is granted until the limit is raised
        tasks = [asyncio.ensure_future(one(started)) for _ in range(waiters)]
        started.set()
        deadline = time.monotonic() + 120
        while await asyncio.to_thread(_queued, pg_dsn, name) < waiters:
            assert time.monotonic() < deadline, "the waiters never all queued"
            await asyncio.sleep(0.2)
        # Raise the limit from 1 to 10,000: one allocation pass grants them all.
        raised = await asyncio.to_thread(
            create_postgres_concurrency_limiter,
            pg_dsn,
            name=name,
            max_concurrent=waiters,
            on_conflict="replace",
        )
        await asyncio.to_thread(raised.reap)
        await asyncio.wait_for(asyncio.gather(*tasks), 180)
        await held.__aexit__(None, None, None)

    asyncio.run(main())
    assert served == waiters
    assert len(tokens) == waiters, "every holder had its own fencing token"
    again = create_postgres_concurrency_limiter(
        pg_dsn, name=name, max_concurrent=waiters, on_conflict="replace"
    )
    with slot(again) as after:
        assert after.fencing_token is not None
        assert after.fencing_token > max(tokens)
    assert again.stats().active == 0
    assert again.stats().queued == 0


def test_a_thousand_async_waiters_while_holders_resolve_names_and_do_io(pg_dsn: str) -> None:
    limiter = create_postgres_concurrency_limiter(
        pg_dsn, name=unique_name("async-io"), max_concurrent=2
    )
    witness = Witness()
    resolved: list[int] = []

    async def one() -> None:
        async with slot(limiter):
            witness.enter()
            loop = asyncio.get_running_loop()
            # The loop's default executor: the holder's own name lookup and file I/O.
            resolved.append(len(await loop.getaddrinfo("localhost", 5432)))
            await asyncio.to_thread(os.stat, ".")
            witness.leave()

    async def main() -> None:
        await asyncio.wait_for(asyncio.gather(*(one() for _ in range(1_000))), 240)

    asyncio.run(main())
    assert len(resolved) == 1_000
    assert witness.most <= 2


def hold_when_told(
    dsn: str, limits: dict[str, Any], busy: bool, resumed: Any, orders: Connection
) -> None:
    """Hold a slot whenever told (``"hold"``), say ``"held"``, stay in the body until
    resumed from a pause, read ``held.aborted`` once and report how the ``with`` ended,
    with the lease's ``lease-lost`` events and the outcomes its release recorded.

    A ``busy`` body computes until ``resumed`` (shared memory) is set: it holds the
    interpreter when stopped, so when resumed it runs before the keeper thread. The
    other one blocks reading ``"finish"``, sent while it is stopped (its keeper thread
    may then run first).
    """
    limiter = create_postgres_concurrency_limiter(dsn, **limits)
    events = EventRecorder()
    add_event_listener(events)
    while orders.recv() == "hold":
        first_read: bool | None = None
        lease_id = ""
        try:
            with slot(limiter) as held:
                lease_id = held.lease.lease_id if held.lease is not None else ""
                orders.send("held")
                if busy:
                    while not resumed.value:  # reading it never lets another thread run
                        pass
                else:
                    orders.recv()
                first_read = held.aborted
            how, said = "success", ""
        except ConcurrencyLeaseLostError as exc:
            how, said = "lease-lost", str(exc)
        except Exception as exc:
            how, said = "failed", f"{type(exc).__name__}: {exc}"

        def of(kind: str, lease_id: str = lease_id) -> list[Any]:
            return [e for e in events.of(kind) if e.lease_id == lease_id]

        with contextlib.suppress(AssertionError):  # whoever noticed may still be saying so
            wait_until(lambda: of("lease-lost"), "the lease-lost event", timeout=2)
        released = [e.outcome for e in of("released")]
        orders.send((how, first_read, said, len(of("lease-lost")), released))


def _stopped(pid: int) -> bool:
    """Whether the process is in the stopped state (Linux ``/proc``)."""
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0] in ("T", "t")


def test_a_holder_paused_past_its_lease_while_another_takes_the_slot_never_ends_with_success(
    pg_dsn: str, stopped_processes: list[Any]
) -> None:
    # Four holder processes, five rounds: twenty trials. In each round every holder
    # holds a slot and stays in its body (two compute, two block on a read); all are
    # stopped; this process takes every slot once their leases have expired; then each
    # holder is resumed (a blocked one finds "finish" waiting). Its first look at
    # held.aborted and its `with` must both say "lost", whichever of its body and its
    # keeper thread runs first.
    holders, rounds = 4, 5
    name = unique_name("paused-holder")
    limits = {"name": name, "max_concurrent": holders, "lease_ttl_ms": 1_000}
    limiter = create_postgres_concurrency_limiter(pg_dsn, **limits)
    resumed = SPAWN.RawValue("b", 0)
    pipes: list[Connection] = []
    for index in range(holders):
        busy = index % 2 == 0
        parent, child = SPAWN.Pipe()
        process = SPAWN.Process(target=hold_when_told, args=(pg_dsn, limits, busy, resumed, child))
        process.start()
        stopped_processes.append(process)
        pipes.append(parent)
    outcomes: list[tuple[str, bool | None, str, int, list[str]]] = []
    for _ in range(rounds):
        resumed.value = 0
        for pipe in pipes:
            pipe.send("hold")
        for pipe in pipes:
            assert pipe.poll(60), "a holder never got its slot"
            assert pipe.recv() == "held"
        for process in stopped_processes:
            os.kill(process.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while not all(_stopped(p.pid) for p in stopped_processes):
            assert time.monotonic() < deadline, "a holder did not stop"
            time.sleep(0.005)
        with contextlib.ExitStack() as taken:
            taken.enter_context(run(timeout_ms=30_000))
            for _ in range(holders):  # granted as the stopped holders' leases expire
                taken.enter_context(slot(limiter))
            for pipe in pipes[1::2]:
                pipe.send("finish")  # to the blocked bodies
            resumed.value = 1  # to the busy ones
            for process in stopped_processes:
                os.kill(process.pid, signal.SIGCONT)
            for pipe in pipes:
                assert pipe.poll(30), "a resumed holder said nothing"
                outcomes.append(pipe.recv())
    for pipe in pipes:
        pipe.send("stop")
    assert len(outcomes) == holders * rounds
    ended = [how for how, *_ in outcomes]
    assert ended == ["lease-lost"] * len(outcomes), outcomes
    first_reads = [first for _, first, *_ in outcomes]
    assert first_reads == [True] * len(outcomes), outcomes
    assert all(said.startswith("lost slot") for _, _, said, *_ in outcomes), outcomes
    assert [lost for *_, lost, _ in outcomes] == [1] * len(outcomes), outcomes
    assert [released for *_, released in outcomes] == [["lease-lost"]] * len(outcomes)
    assert limiter.stats().active == 0
