"""An ``async with slot(...)`` exit never blocks the event loop: its release runs on the
backend's ``runcell-db`` threads (issue 22)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import psycopg

from runcell_celery import slot
from runcell_celery.postgres import PostgresConcurrencyLimiter

ROW_HELD_S = 1.0


def test_an_async_slot_exit_whose_release_waits_for_a_locked_row_leaves_the_loop_free(
    pg_dsn: str, make_limiter: Callable[..., PostgresConcurrencyLimiter]
) -> None:
    limiter = make_limiter(max_concurrent=1)
    locked = threading.Event()

    def hold_the_row() -> None:
        with psycopg.connect(pg_dsn) as conn, conn.transaction():
            conn.execute("SELECT 1 FROM runcell_limiter WHERE name = %s FOR UPDATE", [limiter.name])
            locked.set()
            time.sleep(ROW_HELD_S)  # the release waits for the row meanwhile

    async def main() -> tuple[float, float, list[str]]:
        gaps: list[float] = []
        threads: list[str] = []
        stop = asyncio.Event()

        async def tick() -> None:
            last = time.monotonic()
            while not stop.is_set():
                await asyncio.sleep(0.01)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        ticker = asyncio.create_task(tick())
        original = limiter.release

        def release(*args: object) -> None:
            threads.append(threading.current_thread().name)
            original(*args)  # type: ignore[arg-type]

        limiter.release = release  # type: ignore[method-assign]
        async with slot(limiter):
            locker = threading.Thread(target=hold_the_row)
            locker.start()
            await asyncio.to_thread(locked.wait, 10)
            gaps.clear()
            exit_started = time.monotonic()
        exit_s = time.monotonic() - exit_started
        stop.set()
        await ticker
        locker.join(10)
        return exit_s, max(gaps), threads

    exit_s, longest_gap, threads = asyncio.run(main())
    assert exit_s >= ROW_HELD_S * 0.8, "the release did not wait for the row: proves nothing"
    assert longest_gap < 0.25, f"the event loop stood still {longest_gap:.3f}s during the exit"
    assert threads, "the release never ran"
    assert all(name.startswith("runcell-db") for name in threads), threads
    assert limiter.stats().active == 0
