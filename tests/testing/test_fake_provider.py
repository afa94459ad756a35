"""The fake provider counts what it has in flight, so tests can trust it as a witness.

Every test runs a real server (in a thread or as a process) and real HTTP clients
(threads and spawned processes); nothing is mocked. Latencies only make requests
overlap; no test asserts how long anything took.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import select
import signal
import subprocess
import sys
import threading
import time
import urllib.error
from collections.abc import Callable, Iterator
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier

import pytest

from runcell_celery.testing import (
    FakeProvider,
    FakeProviderClient,
    FakeProviderError,
    FakeProviderStats,
)

#: Long enough that a request cannot end by itself while a test waits on it.
FOREVER_MS = 60_000


def run_in_threads(count: int, call: Callable[[], object]) -> None:
    """Run ``call`` on ``count`` threads released together by a barrier; re-raise failures."""
    barrier = threading.Barrier(count)
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            barrier.wait(timeout=30)
            call()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors


def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def call_ignoring_provider_errors(client: FakeProviderClient, *, fencing: int) -> None:
    with contextlib.suppress(FakeProviderError):
        client.create("hello", fencing_token=fencing, limiter="claude")


def assert_counts_add_up(stats: FakeProviderStats) -> None:
    ended = stats.completed + stats.errors + stats.rejected_stale + stats.disconnected
    assert stats.total == stats.in_flight + ended


def test_counts_every_concurrent_request_in_flight_at_once() -> None:
    with FakeProvider(latency_ms=500) as provider:
        client = provider.client()
        run_in_threads(10, lambda: client.create("hello"))
        stats = provider.wait_idle()
    assert stats.max_in_flight == 10
    assert (stats.total, stats.completed, stats.in_flight) == (10, 10, 0)


def test_a_semaphore_of_three_keeps_max_in_flight_at_exactly_three() -> None:
    semaphore = threading.Semaphore(3)
    with FakeProvider(latency_ms=200) as provider:
        client = provider.client()

        def limited_call() -> None:
            with semaphore:
                client.create("hello")

        run_in_threads(12, limited_call)
        stats = provider.wait_idle()
    assert stats.max_in_flight == 3
    assert stats.completed == 12


def test_stream_yields_chunks_and_stays_in_flight_until_done() -> None:
    with FakeProvider(latency_ms=200) as provider:
        client = provider.client()
        pieces = []
        for piece in client.stream("tell me a story", chunks=4):
            pieces.append(piece)
            if len(pieces) < 4:  # the server still has chunks to send
                assert provider.stats().in_flight == 1
        reply = client.create("tell me a story", latency_ms=0)
        stats = provider.wait_idle()
    assert len(pieces) == 4
    assert "".join(pieces) == reply["content"][0]["text"]
    assert stats.completed == 2


def test_closing_a_stream_early_stops_it_being_counted_in_flight() -> None:
    with FakeProvider() as provider:
        stream = provider.client().stream("long", latency_ms=FOREVER_MS, chunks=600)
        next(stream)
        stream.close()
        stats = provider.wait_idle(timeout=10)
    assert (stats.disconnected, stats.completed, stats.in_flight) == (1, 0, 0)


def test_a_client_that_times_out_stops_being_counted_in_flight() -> None:
    with FakeProvider() as provider:
        impatient = FakeProviderClient(provider.url, timeout=0.2)
        with pytest.raises((TimeoutError, urllib.error.URLError)):
            impatient.create("slow", latency_ms=FOREVER_MS)
        stats = provider.wait_idle(timeout=10)
    assert (stats.disconnected, stats.max_in_flight, stats.in_flight) == (1, 1, 0)


def test_error_rate_one_answers_529_overloaded_and_counts_errors() -> None:
    with FakeProvider(latency_ms=0, error_rate=1.0) as provider:
        client = provider.client()
        with pytest.raises(FakeProviderError) as created:
            client.create("hello")
        with pytest.raises(FakeProviderError) as streamed:
            list(client.stream("hello"))
        stats = provider.wait_idle()
    for error in (created.value, streamed.value):
        assert error.status == 529
        assert error.error_type == "overloaded_error"
    assert (stats.errors, stats.completed, stats.total) == (2, 0, 2)


def test_a_seeded_error_rate_repeats_its_sequence_after_reset() -> None:
    def outcomes(client: FakeProviderClient) -> list[int]:
        statuses = []
        for _ in range(20):
            try:
                client.create("hello", latency_ms=0)
                statuses.append(200)
            except FakeProviderError as error:
                statuses.append(error.status)
        return statuses

    with FakeProvider(error_rate=0.5, seed=7) as provider:
        client = provider.client()
        first = outcomes(client)
        provider.reset()
        second = outcomes(client)
    assert first == second
    assert set(first) == {200, 529}


def test_reset_zeroes_every_counter_and_forgets_fencing_tokens() -> None:
    with FakeProvider(latency_ms=0, error_rate=0.5, seed=1) as provider:
        client = provider.client()
        run_in_threads(6, lambda: call_ignoring_provider_errors(client, fencing=4))
        before = provider.wait_idle()
        after = client.reset()
    assert before.total == 6
    assert before.max_in_flight >= 1
    assert before.fencing_tokens == {"claude": 4}
    assert after == FakeProviderStats()
    assert provider.stats() == FakeProviderStats()


def test_reset_carries_requests_still_in_flight_into_the_new_count() -> None:
    with FakeProvider() as provider:
        stream = provider.client().stream("long", latency_ms=FOREVER_MS, chunks=600)
        next(stream)
        stats = provider.reset()
        stream.close()
        after = provider.wait_idle()
    assert (stats.in_flight, stats.max_in_flight, stats.total) == (1, 1, 1)
    assert (after.in_flight, after.disconnected) == (0, 1)
    assert_counts_add_up(after)


def test_strict_fencing_rejects_a_token_older_than_one_already_seen() -> None:
    with FakeProvider(latency_ms=0, strict_fencing=True) as provider:
        client = provider.client()
        client.create("first holder", fencing_token=5, limiter="claude")
        client.create("newer holder", fencing_token=7, limiter="claude")
        client.create("same holder again", fencing_token=7, limiter="claude")
        client.create("another limiter", fencing_token=1, limiter="batch")
        with pytest.raises(FakeProviderError) as stale:
            client.create("stale holder", fencing_token=6, limiter="claude")
        stats = provider.wait_idle()
    assert stale.value.status == 409
    assert stale.value.error_type == "stale_fencing_token"
    assert (stats.rejected_stale, stats.completed) == (1, 4)
    assert stats.fencing_tokens == {"claude": 7, "batch": 1}
    assert_counts_add_up(stats)


def test_fencing_is_not_enforced_by_default_because_holders_overlap() -> None:
    with FakeProvider(latency_ms=0) as provider:
        client = provider.client()
        client.create("newer holder", fencing_token=7, limiter="claude")
        client.create("older holder, still valid", fencing_token=6, limiter="claude")
        stats = provider.wait_idle()
    assert (stats.rejected_stale, stats.completed) == (0, 2)
    assert stats.fencing_tokens == {"claude": 7}


def test_invalid_requests_are_answered_400_and_counted_as_errors() -> None:
    with FakeProvider(latency_ms=0) as provider:
        client = provider.client()
        with pytest.raises(FakeProviderError) as negative:
            client.create("hello", latency_ms=-1)
        with pytest.raises(ValueError, match="limiter"):
            client.create("hello", fencing_token=3)
        stats = provider.wait_idle()
    assert negative.value.status == 400
    assert negative.value.error_type == "invalid_request_error"
    assert (stats.errors, stats.total) == (1, 1)


def test_invalid_settings_name_the_field_and_value() -> None:
    with pytest.raises(ValueError, match=r"error_rate .* 1\.5"):
        FakeProvider(error_rate=1.5)
    with pytest.raises(ValueError, match="latency_ms"):
        FakeProvider(latency_ms=(200, 100))


def test_stopping_ends_requests_still_waiting_and_keeps_the_counters() -> None:
    provider = FakeProvider().start()
    client = provider.client()
    errors: list[FakeProviderError] = []

    def call() -> None:
        try:
            client.create("slow", latency_ms=FOREVER_MS)
        except FakeProviderError as error:
            errors.append(error)

    caller = threading.Thread(target=call)
    caller.start()
    try:
        wait_for(lambda: provider.stats().in_flight == 1)
    finally:
        provider.stop()
    caller.join(timeout=10)
    assert [error.status for error in errors] == [503]
    assert (provider.stats().in_flight, provider.stats().errors) == (0, 1)


def test_the_client_raises_a_clear_error_for_an_unknown_path() -> None:
    with FakeProvider() as provider:
        client = FakeProviderClient(provider.url + "/nowhere")
        with pytest.raises(FakeProviderError, match="HTTP 404"):
            client.health()


# -- as a separate process ------------------------------------------------------------


def _call_from_a_spawned_process(
    client: FakeProviderClient, barrier: Barrier, results: Queue[tuple[int, str]]
) -> None:
    barrier.wait(timeout=60)
    reply = client.create(f"from process {os.getpid()}", latency_ms=1_000)
    results.put((os.getpid(), reply["content"][0]["text"]))


def _read_first_line(process: subprocess.Popen[str], timeout: float) -> str:
    assert process.stdout is not None
    ready, _, _ = select.select([process.stdout], [], [], timeout)
    assert ready, "the fake provider printed no URL"
    return process.stdout.readline().strip()


def _stop_by_pid(process: subprocess.Popen[str]) -> tuple[str, str]:
    """SIGTERM the process by its PID, SIGKILL it if it does not exit; return its output."""
    if process.poll() is None:
        os.kill(process.pid, signal.SIGTERM)
    try:
        return process.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        os.kill(process.pid, signal.SIGKILL)
        return process.communicate()


@pytest.fixture
def provider_process() -> Iterator[tuple[subprocess.Popen[str], str]]:
    """Start ``python -m runcell_celery.testing.fake_provider``; always stop it by PID."""
    process = subprocess.Popen(
        [sys.executable, "-m", "runcell_celery.testing.fake_provider", "--latency-ms", "10"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        yield process, _read_first_line(process, timeout=30)
    finally:
        _stop_by_pid(process)


def test_as_a_process_it_counts_calls_from_two_spawned_processes(
    provider_process: tuple[subprocess.Popen[str], str],
) -> None:
    _, url = provider_process
    client = FakeProviderClient(url)
    assert client.health() == {"status": "ok"}
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(2)
    results: Queue[tuple[int, str]] = context.Queue()
    children = [
        context.Process(target=_call_from_a_spawned_process, args=(client, barrier, results))
        for _ in range(2)
    ]
    for child in children:
        child.start()
    try:
        replies = dict(results.get(timeout=60) for _ in children)
    finally:
        for child in children:
            child.join(timeout=30)
            if child.is_alive():
                child.kill()
    stats = client.wait_idle()
    assert len(replies) == 2
    assert os.getpid() not in replies
    assert all(text == f"fake reply to: from process {pid}" for pid, text in replies.items())
    assert (stats.total, stats.completed, stats.max_in_flight) == (2, 2, 2)
    assert [child.exitcode for child in children] == [0, 0]


def test_as_a_process_it_stops_cleanly_on_sigterm_and_reports_its_counters(
    provider_process: tuple[subprocess.Popen[str], str],
) -> None:
    process, url = provider_process
    FakeProviderClient(url).create("hello")
    _, stderr = _stop_by_pid(process)
    assert process.returncode == 0
    final = json.loads(stderr.strip().splitlines()[-1])
    assert (final["total"], final["completed"]) == (1, 1)
