"""The PostgreSQL backend's port: its options, its stores and what operators ask of it."""

from __future__ import annotations

import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import pytest

from runcell_celery import (
    AcquireRequest,
    ConcurrencyConfigError,
    Lease,
    LimiterConfig,
    RunLineage,
    slot,
)
from runcell_celery.ports import (
    AdmissionCount,
    Backend,
    CounterStore,
    Parked,
    ParkingStore,
    RevocationStore,
    RunStore,
    SupportsParking,
)
from runcell_celery.postgres import PostgresBackend, PostgresOptions
from runcell_celery.protocol import Member
from tests.support.pg import unique_name

SOON_S = 15.0
PAYLOAD = '{"task": "demo.summarize"}'


@pytest.fixture
def backend(pg_dsn: str) -> Iterator[PostgresBackend]:
    made = PostgresBackend(database=pg_dsn, options={"poll_interval_ms": 20})
    try:
        yield made
    finally:
        made.close()


def _request(workload: str = "default", *, request_id: str | None = None) -> AcquireRequest:
    rid = request_id or unique_name("request")
    return AcquireRequest(request_id=rid, workload=workload, lineage=RunLineage(rid, rid))


def _config(**options: object) -> LimiterConfig:
    return LimiterConfig.from_mapping({"max_concurrent": 1, **options}, name=unique_name())


def _wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + SOON_S
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.01)


# -- options --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"poll_intervall_ms": 10},
            'RUNCELL["POSTGRES"]["poll_intervall_ms"] is invalid: unknown option; '
            "did you mean 'poll_interval_ms'?",
        ),
        (
            {"queue_entry_ttl_ms": 0},
            'RUNCELL["POSTGRES"]["queue_entry_ttl_ms"] = 0 is invalid: must be a positive integer',
        ),
        (
            {"pool_max_size": True},
            'RUNCELL["POSTGRES"]["pool_max_size"] = True is invalid: must be a positive integer',
        ),
        (
            {"listen": "no"},
            'RUNCELL["POSTGRES"]["listen"] = \'no\' is invalid: must be True or False',
        ),
        (
            {"on_conflict": "merge"},
            'RUNCELL["POSTGRES"]["on_conflict"] = \'merge\' is invalid: '
            "must be 'error', 'replace' or 'use_stored'",
        ),
        (
            [("listen", False)],
            "RUNCELL[\"POSTGRES\"] = [('listen', False)] is invalid: must be a dict",
        ),
    ],
)
def test_the_backend_names_a_bad_option_by_its_settings_path_and_value(
    options: object, message: str
) -> None:
    with pytest.raises(ConcurrencyConfigError, match=re.escape(message)):
        PostgresBackend(database=None, options=options)  # type: ignore[arg-type]


def test_options_name_the_settings_path_they_were_given() -> None:
    with pytest.raises(
        ConcurrencyConfigError, match=re.escape('app.conf.runcell["POSTGRES"]["x"]')
    ):
        PostgresBackend(database=None, options={"x": 1}, path='app.conf.runcell["POSTGRES"]')


def test_omitted_options_take_their_documented_defaults() -> None:
    backend = PostgresBackend(database=None, options={"listen": False})
    assert backend.options == PostgresOptions(listen=False)
    assert (backend.options.poll_interval_ms, backend.options.on_conflict) == (100, "error")


def test_a_backend_without_a_database_checks_its_options_but_refuses_to_work() -> None:
    backend = PostgresBackend(database=None)
    with pytest.raises(ConcurrencyConfigError, match="has no database"):
        backend.create_limiter(_config())


def test_the_backend_offers_every_store_and_its_limiters_can_park(
    backend: PostgresBackend,
) -> None:
    for port in (Backend, RunStore, RevocationStore, CounterStore, ParkingStore):
        assert isinstance(backend, port), port.__name__
    assert isinstance(backend.create_limiter(_config()), SupportsParking)


# -- limiters share the backend's pool -------------------------------------------------


def test_every_limiter_of_a_backend_uses_its_one_pool(backend: PostgresBackend) -> None:
    first = backend.create_limiter(_config())
    second = backend.create_limiter(_config(max_concurrent=3))
    assert first.pool is second.pool is backend.pool
    assert first.options is backend.options


# -- RunStore -----------------------------------------------------------------------------


def test_first_start_keeps_the_first_budget_and_answers_the_milliseconds_left(
    backend: PostgresBackend,
) -> None:
    run_id = unique_name("run")
    first = backend.first_start(run_id, 60_000)
    assert 0 < first <= 60_000
    # A redelivery asks with a fresh budget: the first start's deadline still holds.
    again = backend.first_start(run_id, 3_600_000)
    assert 0 < again <= first
    assert backend.first_start(unique_name("run"), 0) <= 0


# -- RevocationStore ----------------------------------------------------------------------


def test_revocations_are_shared_and_purged_after_they_are_kept_long_enough(
    backend: PostgresBackend,
) -> None:
    revoked, other = unique_name("revoked"), unique_name("other")
    assert backend.add_revoked([revoked]) == 1
    assert backend.add_revoked([revoked]) == 0, "a revocation is recorded once"
    assert backend.revoked_among([revoked, other]) == {revoked}
    assert backend.revoked_among([]) == set()
    backend.purge_revoked(keep_ms=3_600_000)
    assert backend.revoked_among([revoked]) == {revoked}, "kept while younger than keep_ms"
    assert backend.purge_revoked(keep_ms=0) >= 1
    assert backend.revoked_among([revoked]) == set()


# -- CounterStore -------------------------------------------------------------------------


def test_admission_counts_from_several_batches_add_up(backend: PostgresBackend) -> None:
    task = unique_name("task")
    backend.add_counts(
        [
            AdmissionCount(task, "claude", deliveries=2, deferrals=1),
            AdmissionCount(task, "gpt", deliveries=1, provider_attempts=1),
        ]
    )
    backend.add_counts([AdmissionCount(task, "claude", deliveries=3, provider_failures=2)])
    backend.add_counts([])
    mine = {c.limiter: c for c in backend.admission_counts() if c.task_name == task}
    assert mine == {
        "claude": AdmissionCount(task, "claude", deliveries=5, deferrals=1, provider_failures=2),
        "gpt": AdmissionCount(task, "gpt", deliveries=1, provider_attempts=1),
    }


# -- ParkingStore -------------------------------------------------------------------------


def test_a_grant_to_a_parked_request_is_claimed_for_publication_exactly_once(
    backend: PostgresBackend,
) -> None:
    limiter = backend.create_limiter(_config())
    held = limiter.acquire(_request())
    parked = _request()
    assert isinstance(
        limiter.acquire_or_park([Member(limiter, parked)], admission_wait_ms=0, payload=PAYLOAD),
        Parked,
    )
    granted: list[list[str]] = []
    limiter.set_parked_granted_handler(granted.append)

    limiter.release(held)  # grants the parked request, in this process

    assert len(granted) == 1
    assert len(granted[0]) == 1
    (claim,) = backend.claim_republish(granted[0], stale_ms=60_000)
    assert (claim.limiter, claim.request_id, claim.payload) == (
        limiter.name,
        parked.request_id,
        PAYLOAD,
    )
    again = backend.claim_republish(granted[0], stale_ms=0)
    assert [c for c in again if c.limiter == limiter.name] == [], "claimed once only"
    (lease,) = limiter.claim_parked([limiter], parked.request_id, claim.publication_id)
    assert lease is not None
    assert lease.request_id == parked.request_id
    limiter.release(lease)


def test_other_processes_hear_of_parked_grants_through_the_backend(
    backend: PostgresBackend,
) -> None:
    heard: list[tuple[str, list[str]]] = []
    backend.on_parked_granted(lambda limiter, ids: heard.append((limiter, ids)))
    limiter = backend.create_limiter(_config())
    _wait_for(lambda: limiter.listening is True, "the listener is connected")
    held = limiter.acquire(_request())
    parked = _request()
    assert isinstance(
        limiter.acquire_or_park([Member(limiter, parked)], admission_wait_ms=0, payload=PAYLOAD),
        Parked,
    )

    limiter.release(held)

    _wait_for(lambda: (limiter.name, [parked.request_id]) in heard, "the grant was announced")


def test_parked_requests_past_their_deadline_are_taken_out(backend: PostgresBackend) -> None:
    limiter = backend.create_limiter(_config())
    held = limiter.acquire(_request())
    rid = unique_name("stale")
    stale = AcquireRequest(rid, "default", RunLineage(rid, "root", "parent"), timeout_ms=50)
    assert isinstance(
        limiter.acquire_or_park([Member(limiter, stale)], admission_wait_ms=0, payload=PAYLOAD),
        Parked,
    )
    expired: list[str] = []
    _wait_for(
        lambda: bool(
            expired.extend(e.request_id for e in backend.take_expired_parked()) or rid in expired
        ),
        "the parked request expired",
    )
    assert limiter.stats().queued == 0
    limiter.release(held)


# -- operators ------------------------------------------------------------------------------


def test_force_release_expires_the_lease_and_hands_the_slot_to_a_waiter_at_once(
    backend: PostgresBackend, pg_dsn: str
) -> None:
    # The waiter polls once a minute and listens: only the force release's own
    # allocation pass (and its NOTIFY) can serve it before the join gives up.
    slow = PostgresBackend(database=pg_dsn, options={"poll_interval_ms": 60_000})
    limiter = slow.create_limiter(_config(workloads={"batch": {}}))
    _wait_for(lambda: limiter.listening is True, "the listener is connected")
    held = limiter.acquire(_request("batch"))
    got: list[Lease] = []
    checked = threading.Event()

    def wait() -> None:
        with slot(limiter, workload="batch") as waiting:
            assert waiting.lease is not None
            got.append(waiting.lease)
            checked.wait(SOON_S)  # held until the counts were read

    waiter = threading.Thread(target=wait)
    waiter.start()
    _wait_for(lambda: limiter.stats().queued == 1, "the waiter is queued")

    (released,) = backend.force_release([held.lease_id, str(uuid.uuid4())])

    assert (released.lease_id, released.limiter, released.workload) == (
        held.lease_id,
        limiter.name,
        "batch",
    )
    assert (released.request_id, released.fencing_token) == (held.request_id, held.fencing_token)
    state = backend.limiter_states([limiter.name])[limiter.name]
    assert (state.total_active, state.total_queued) == (1, 0), "granted before it returned"
    checked.set()
    waiter.join(SOON_S)
    assert not waiter.is_alive()
    assert got[0].fencing_token > held.fencing_token
    assert limiter.renew(held) is None, "the old holder finds out at its next renewal"
    assert backend.force_release([held.lease_id]) == []


def test_stored_limits_are_read_back_as_configs(backend: PostgresBackend) -> None:
    config = _config(max_concurrent=4, workloads={"interactive": {"reserved": 1}, "batch": {}})
    backend.create_limiter(config)
    stored = backend.stored_limits([config.name, "no-such-limiter"])
    assert stored == {config.name: config}
    assert config.name in backend.stored_limits()


def test_limiter_states_count_what_the_limiter_itself_counts(backend: PostgresBackend) -> None:
    limiter = backend.create_limiter(
        _config(max_concurrent=2, workloads={"interactive": {}, "batch": {}, "idle": {}})
    )
    idle = backend.limiter_states([limiter.name])[limiter.name]
    assert idle.stats() == limiter.stats()
    assert idle.oldest_wait_ms is None
    held = [limiter.acquire(_request("interactive")), limiter.acquire(_request("batch"))]
    for workload in ("interactive", "batch", "batch"):
        assert isinstance(
            limiter.acquire_or_park(
                [Member(limiter, _request(workload))], admission_wait_ms=0, payload=PAYLOAD
            ),
            Parked,
        )

    state = backend.limiter_states([limiter.name])[limiter.name]

    assert state.stats() == limiter.stats()
    assert dict(state.active) == {"interactive": 1, "batch": 1}
    assert dict(state.queued) == {"interactive": 1, "batch": 2}
    assert state.workloads == ("batch", "idle", "interactive")
    assert state.oldest_wait_ms is not None
    assert state.oldest_wait_ms >= 0
    for lease in held:
        limiter.release(lease)
