"""A wait span says where the request joined the line (``runcell.queue.place``) and,
when the limiter knows its mean hold time, how long it was expected to wait.

Real limiters on both backends (in memory; PostgreSQL on the session's throwaway
database), real threads for contention, the OpenTelemetry SDK's in-memory exporter.
Every waiter enters the line only once the one before it waits, so the places are
known in advance.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import psycopg
import pytest
from opentelemetry.util.types import Attributes

import runcell_celery.memory
from runcell_celery import (
    CancellationToken,
    ConcurrencyTimeoutError,
    Lease,
    create_concurrency_limiter,
    run,
    slot,
)
from runcell_celery.admission import Admission, Deferred
from runcell_celery.ports import Parked
from runcell_celery.protocol import (
    AcquireRequest,
    ConcurrencyLimiter,
    Member,
    OnWait,
    Outcome,
    QueuePlace,
    RunLineage,
)
from runcell_celery.slot import preadmit
from tests.conftest import wait_until
from tests.support.pg import make_limiter, pg_dsn
from tests.tracing.conftest import RecordedSpans

__all__ = ["make_limiter", "pg_dsn"]

MakeLimiter = Callable[..., Any]


@pytest.fixture(params=["memory", "postgres"])
def backend(request: pytest.FixtureRequest) -> MakeLimiter:
    """``backend(max_concurrent, **options)``: a new limiter of the backend under test
    (PostgreSQL: on the session's throwaway database)."""
    if request.param == "memory":

        def in_memory(max_concurrent: int, **options: Any) -> Any:
            name = f"place-{uuid.uuid4().hex[:8]}"
            return create_concurrency_limiter(max_concurrent, name=name, **options)

        return in_memory
    on_postgres: MakeLimiter = request.getfixturevalue("make_limiter")
    return lambda max_concurrent, **options: on_postgres(max_concurrent=max_concurrent, **options)


class Line:
    """Threads that hold slots until :meth:`let_go`, and threads that wait behind them,
    each started once the one before it waits."""

    def __init__(self) -> None:
        self.let_go_event = threading.Event()
        self.threads: list[threading.Thread] = []
        self.errors: list[BaseException] = []

    def _start(self, body: Callable[[], None], name: str) -> None:
        def run() -> None:
            try:
                body()
            except BaseException as exc:
                self.errors.append(exc)

        thread = threading.Thread(target=run, name=name)
        thread.start()
        self.threads.append(thread)

    def hold(self, *limiters: ConcurrencyLimiter) -> None:
        """A thread takes a slot of ``limiters`` and keeps it until :meth:`let_go`."""
        entered = threading.Event()

        def body() -> None:
            with slot(*limiters):
                entered.set()
                self.let_go_event.wait(30)

        self._start(body, "test-holder")
        assert entered.wait(10), "the holder never got its slot"

    def join(
        self,
        *limiters: ConcurrencyLimiter,
        request_id: str,
        waits: Callable[[], bool],
        workload: str | None = None,
    ) -> None:
        """A thread asks for a slot as ``request_id``; return once ``waits()``."""

        def body() -> None:
            with slot(*limiters, request_id=request_id, workload=workload):
                pass

        self._start(body, f"test-{request_id}")
        wait_until(waits, f"{request_id} waits")

    def let_go(self) -> None:
        """The holders release; every waiter gets its slot in turn and leaves."""
        self.let_go_event.set()
        for thread in self.threads:
            thread.join(30)
        assert not [t for t in self.threads if t.is_alive()], "a thread is still waiting"


@pytest.fixture
def line() -> Iterator[Line]:
    made = Line()
    yield made
    made.let_go()


def _queued(*limiters: Any) -> int:
    return sum(limiter.stats().queued for limiter in limiters)


def _ids(prefix: str, *names: str) -> dict[str, str]:
    """Request ids unique to this test (PostgreSQL keeps them in a shared database)."""
    tag = uuid.uuid4().hex[:8]
    return {name: f"{prefix}-{name}-{tag}" for name in names}


def _waits_by_request(spans: RecordedSpans) -> dict[str, Attributes]:
    found: dict[str, Attributes] = {}
    for span in spans.waits():
        assert span.attributes is not None
        found[str(span.attributes["runcell.request_id"])] = span.attributes
    return found


def _mean_hold_ms(dsn: str, limiter: str) -> float:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT hold_ms_avg FROM runcell_limiter WHERE name = %s", (limiter,)
        ).fetchone()
    assert row is not None
    assert row[0] is not None, f"no mean hold time for {limiter}"
    return float(row[0])


def test_a_queued_wait_records_its_place_in_its_workloads_line(
    spans: RecordedSpans, line: Line, backend: MakeLimiter
) -> None:
    limiter = backend(1, workloads={"chat": {}, "batch": {}}, default_workload="chat")
    ids = _ids("line", "chat-1", "batch-1", "chat-2")
    line.hold(limiter)
    line.join(limiter, request_id=ids["chat-1"], waits=lambda: _queued(limiter) == 1)
    line.join(
        limiter, request_id=ids["batch-1"], workload="batch", waits=lambda: _queued(limiter) == 2
    )
    line.join(limiter, request_id=ids["chat-2"], waits=lambda: _queued(limiter) == 3)
    line.let_go()

    waits = _waits_by_request(spans)
    assert {waits[ids[n]]["runcell.queue.place"] for n in ("chat-1", "batch-1")} == {1}  # type: ignore[index]
    assert waits[ids["chat-2"]]["runcell.queue.place"] == 2  # type: ignore[index]
    for request_id in ids.values():
        assert waits[request_id]["runcell.outcome"] == "granted"  # type: ignore[index]
        # Nothing was released before they queued: no mean hold time to estimate from.
        assert "runcell.queue.expected_wait_ms" not in waits[request_id]  # type: ignore[operator]
    holder = [a for rid, a in waits.items() if rid not in ids.values()]
    assert len(holder) == 1
    assert "runcell.queue.place" not in holder[0]  # type: ignore[operator]  # granted at once


def test_the_expected_wait_is_the_place_times_the_mean_hold_over_the_slots(
    spans: RecordedSpans, line: Line, make_limiter: MakeLimiter, pg_dsn: str
) -> None:
    limiter = make_limiter(max_concurrent=2, workloads={"chat": {"max_concurrent": 2}})
    with slot(limiter):  # one hold, so the limiter has a mean hold time
        pass
    hold_ms = _mean_hold_ms(pg_dsn, limiter.name)
    ids = _ids("expected", "first", "second")
    line.hold(limiter)
    line.hold(limiter)
    line.join(limiter, request_id=ids["first"], waits=lambda: _queued(limiter) == 1)
    line.join(limiter, request_id=ids["second"], waits=lambda: _queued(limiter) == 2)
    line.let_go()

    waits = _waits_by_request(spans)
    for place, name in enumerate(("first", "second"), start=1):
        attributes = waits[ids[name]]
        assert attributes is not None
        assert attributes["runcell.queue.place"] == place
        expected = attributes["runcell.queue.expected_wait_ms"]
        assert expected == pytest.approx(place * hold_ms / 2)


def test_a_timed_out_wait_still_says_where_it_stood(
    spans: RecordedSpans, line: Line, backend: MakeLimiter
) -> None:
    limiter = backend(1, workloads={"chat": {"max_wait_ms": 400}}, default_workload="chat")
    ids = _ids("timeout", "first", "second")
    line.hold(limiter)
    line.join(limiter, request_id=ids["first"], waits=lambda: _queued(limiter) == 1)
    with pytest.raises(ConcurrencyTimeoutError):
        slot(limiter, request_id=ids["second"]).__enter__()
    wait_until(lambda: ids["first"] in _waits_by_request(spans), "the first wait ends too")
    waits = _waits_by_request(spans)
    assert waits[ids["second"]]["runcell.outcome"] == "timed-out"  # type: ignore[index]
    assert waits[ids["second"]]["runcell.queue.place"] == 2  # type: ignore[index]
    assert [type(e) for e in line.errors] == [ConcurrencyTimeoutError]


def test_a_wait_over_several_limiters_records_the_largest_of_its_places(
    spans: RecordedSpans, line: Line, backend: MakeLimiter
) -> None:
    a, b = backend(1), backend(1)
    ids = _ids("several", "a-1", "b-1", "b-2", "both")
    line.hold(a)
    line.hold(b)
    line.join(a, request_id=ids["a-1"], waits=lambda: _queued(a) == 1)
    line.join(b, request_id=ids["b-1"], waits=lambda: _queued(b) == 1)
    line.join(b, request_id=ids["b-2"], waits=lambda: _queued(b) == 2)
    # Second in a's line, third in b's: granted when both let it through.
    line.join(a, b, request_id=ids["both"], waits=lambda: _queued(a, b) == 5)
    line.let_go()

    both = _waits_by_request(spans)[ids["both"]]
    assert both is not None
    assert both["runcell.limiters"] == (a.name, b.name)
    assert both["runcell.outcome"] == "granted"
    assert both["runcell.queue.place"] == 3
    assert "runcell.queue.expected_wait_ms" not in both


def test_over_several_postgres_limiters_the_expected_wait_is_the_longest_of_its_lines(
    spans: RecordedSpans, line: Line, make_limiter: MakeLimiter, pg_dsn: str
) -> None:
    a, b = make_limiter(max_concurrent=1), make_limiter(max_concurrent=2)
    for limiter in (a, b):
        with slot(limiter):  # each gets a mean hold time
            pass
    hold_a, hold_b = _mean_hold_ms(pg_dsn, a.name), _mean_hold_ms(pg_dsn, b.name)
    ids = _ids("longest", "a-1", "both")
    line.hold(a)
    line.hold(b)
    line.hold(b)
    line.join(a, request_id=ids["a-1"], waits=lambda: _queued(a) == 1)
    line.join(b, a, request_id=ids["both"], waits=lambda: _queued(a, b) == 3)
    line.let_go()

    both = _waits_by_request(spans)[ids["both"]]
    assert both is not None
    assert both["runcell.queue.place"] == 2  # a's line; first in b's
    expected = both["runcell.queue.expected_wait_ms"]
    assert expected == pytest.approx(max(2 * hold_a / 1, 1 * hold_b / 2))


def test_a_run_over_several_postgres_limiters_parked_by_deferral_records_its_place(
    spans: RecordedSpans, line: Line, make_limiter: MakeLimiter
) -> None:
    a, b = make_limiter(max_concurrent=1), make_limiter(max_concurrent=1)
    ids = _ids("parked", "b-1", "run")
    line.hold(a)
    line.hold(b)
    line.join(b, request_id=ids["b-1"], waits=lambda: _queued(b) == 1)

    def acquire_members(
        members: Sequence[Member], cancel: CancellationToken | None, on_wait: OnWait
    ) -> Deferred:
        result = a.acquire_or_park(
            members, payload="{}", admission_wait_ms=0, cancel=cancel, on_wait=on_wait
        )
        assert isinstance(result, Parked), result
        return Deferred(result)

    admission = Admission(acquire_members, limiters=(a, b), request_id=ids["run"])
    try:
        with run(limiter=[a, b], admission=admission):
            assert isinstance(preadmit(admission), Deferred)
    finally:
        a.withdraw_members([a, b], ids["run"])
    # The line leaves while its limiters are open (make_limiter closes them before the
    # line fixture's teardown would let it go).
    line.let_go()
    wait = _waits_by_request(spans)[ids["run"]]
    assert wait is not None
    assert wait["runcell.outcome"] == "deferred"
    assert wait["runcell.queue.place"] == 2  # first in a's line, second in b's


def test_an_async_wait_records_its_place(
    spans: RecordedSpans, line: Line, backend: MakeLimiter
) -> None:
    limiter = backend(1)
    ids = _ids("async", "first", "second")
    line.hold(limiter)
    line.join(limiter, request_id=ids["first"], waits=lambda: _queued(limiter) == 1)

    def let_go_once_it_waits() -> None:
        wait_until(lambda: _queued(limiter) == 2, "the async request waits")
        line.let_go()

    releaser = threading.Thread(target=let_go_once_it_waits, name="test-releaser")
    releaser.start()

    async def second() -> None:
        async with slot(limiter, request_id=ids["second"]):
            pass

    asyncio.run(second())
    releaser.join(30)
    assert _waits_by_request(spans)[ids["second"]]["runcell.queue.place"] == 2  # type: ignore[index]


def test_without_a_tracer_provider_no_line_is_counted(
    no_tracer_provider: None, line: Line, monkeypatch: pytest.MonkeyPatch
) -> None:
    counted: list[QueuePlace] = []
    count_line = runcell_celery.memory.place_in_line

    def counting(*args: Any) -> QueuePlace:
        counted.append(count_line(*args))
        return counted[-1]

    monkeypatch.setattr("runcell_celery.memory.place_in_line", counting)
    limiter = create_concurrency_limiter(1, name=f"uncounted-{uuid.uuid4().hex[:8]}")
    line.hold(limiter)
    line.join(limiter, request_id="untraced", waits=lambda: _queued(limiter) == 1)
    line.let_go()
    assert counted == []

    from tests.tracing.conftest import set_tracer_provider

    recorded = set_tracer_provider()  # the same wait, traced, does count it
    try:
        traced = Line()
        traced.hold(limiter)
        traced.join(limiter, request_id="traced", waits=lambda: _queued(limiter) == 1)
        traced.let_go()
    finally:
        recorded.provider.shutdown()
    assert counted == [QueuePlace(place=1)]


# -- on_wait stays what it was for callbacks and limiters that know nothing of places --


class _Observer:
    """An ``on_wait`` that wants the place (an ``OnWaitWithPlace``), recording calls."""

    def __init__(self, wants: bool) -> None:
        self.wants = wants
        self.calls: list[tuple[str, object]] = []

    def __call__(self, deadline: float | None) -> None:
        self.calls.append(("deadline", deadline))

    def wants_place(self) -> bool:
        return self.wants

    def placed(self, place: QueuePlace) -> None:
        self.calls.append(("placed", place))


def _acquire_behind_a_holder(limiter: Any, on_wait: OnWait) -> None:
    """Ask ``limiter`` directly (no slot runtime) while another request holds its slot."""
    held = limiter.acquire(_request())
    waiting = threading.Thread(
        target=lambda: limiter.release(limiter.acquire(_request(), on_wait=on_wait))
    )
    waiting.start()
    wait_until(lambda: _queued(limiter) == 1, "the request waits")
    limiter.release(held)
    waiting.join(30)
    assert not waiting.is_alive()


def _request() -> AcquireRequest:
    request_id = f"direct-{uuid.uuid4().hex}"
    return AcquireRequest(
        request_id=request_id,
        workload="default",
        lineage=RunLineage(request_id, request_id),
        timeout_ms=30_000,
    )


def test_a_plain_on_wait_function_still_gets_the_deadline_alone(
    spans: RecordedSpans, backend: MakeLimiter
) -> None:
    limiter = backend(1)
    deadlines: list[object] = []
    # Even while a tracer records spans (the fixture), a callback of one argument
    # written before places existed is called as it always was.
    _acquire_behind_a_holder(limiter, deadlines.append)
    assert len(deadlines) == 1
    assert isinstance(deadlines[0], float)


def test_an_on_wait_that_wants_the_place_is_told_it_before_the_deadline(
    backend: MakeLimiter,
) -> None:
    limiter = backend(1)
    wanting, not_wanting = _Observer(wants=True), _Observer(wants=False)
    _acquire_behind_a_holder(limiter, wanting)
    _acquire_behind_a_holder(limiter, not_wanting)
    assert [kind for kind, _ in wanting.calls] == ["placed", "deadline"]
    place = wanting.calls[0][1]
    assert isinstance(place, QueuePlace)
    assert place.place == 1
    assert [kind for kind, _ in not_wanting.calls] == ["deadline"]


class _DeadlineOnly:
    """A custom limiter written before places: it calls ``on_wait(deadline)`` itself."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    @property
    def name(self) -> str:
        return str(self.inner.name)

    def acquire(
        self,
        request: AcquireRequest,
        *,
        cancel: CancellationToken | None = None,
        on_wait: OnWait | None = None,
    ) -> Lease:
        def told(deadline: float | None) -> None:
            if on_wait is not None:
                on_wait(deadline)

        lease: Lease = self.inner.acquire(request, cancel=cancel, on_wait=told)
        return lease

    def renew(self, lease: Lease) -> Lease | None:
        renewed: Lease | None = self.inner.renew(lease)
        return renewed

    def release(self, lease: Lease, outcome: Outcome = "success") -> None:
        self.inner.release(lease, outcome)


def test_a_limiter_that_only_tells_the_deadline_records_its_wait_without_a_place(
    spans: RecordedSpans, line: Line
) -> None:
    inner = create_concurrency_limiter(1, name=f"old-{uuid.uuid4().hex[:8]}")
    limiter = _DeadlineOnly(inner)
    line.hold(inner)
    line.join(limiter, request_id="old-style", waits=lambda: _queued(inner) == 1)
    line.let_go()
    wait = _waits_by_request(spans)["old-style"]
    assert wait is not None
    assert wait["runcell.outcome"] == "granted"
    assert "runcell.queue.place" not in wait
