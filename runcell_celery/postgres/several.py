"""Several PostgreSQL limiters in one slot: one request, granted all together.

``slot(openai, gpt_4o, tenants.key("acme"))`` on limiters of one database asks once
(``runcell_acquire_several_v5``: their rows locked in name order, one slot in each or
none). A request that must wait leaves one queue row per limiter (its *members*,
``"<request id>|<limiter>"``) and holds nothing. Allocation in any of those limiters
never grants a member by itself: a member that is first in line there, and first in
every other limiter of the request, has its slot set aside (no starvation), and the
transaction that found it tells its caller to run the request's *group pass*
(``runcell_allocate_group_v5``), which locks every limiter of the request in name order
and grants them all together. A member that waits behind others elsewhere holds up
nobody (no head-of-line blocking). Because every statement that locks several limiter
rows locks them in name order, two requests naming the same limiters in opposite
orders cannot deadlock.

The waiting process runs the group pass itself now and then as well
(:data:`GROUP_PASS_S`), so a pass a releaser could not run (it crashed after its commit)
is only late, never lost.
"""

from __future__ import annotations

import contextlib
import functools
import json
import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, LiteralString, Protocol

from ..cancellation import CancellationToken
from ..deadline import Deadline
from ..errors import ConcurrencyConfigError, ConcurrencyError
from ..ports import ClaimMiss, Duplicate, Parked, WaitEstimate
from ..protocol import (
    AcquireRequest,
    ConcurrencyLimiter,
    Lease,
    OnWait,
    QueuePlace,
    announce_wait,
    wants_place,
)
from . import statements
from .calls import (
    WITHDRAW_GRACE_MS,
    LimitsReplacedError,
    RowBusyError,
    Stamp,
    lock_timeout_ms,
)
from .connection import Database
from .parking import ParkRule
from .waiting import Grant, Waiter, WaitRoom

if TYPE_CHECKING:
    from ..errors import (
        ConcurrencyCancelledError,
        ConcurrencyQueueFullError,
        ConcurrencyTimeoutError,
    )

__all__ = [
    "GROUP_PASS_S",
    "acquire_several",
    "claim_parked_group",
    "member_id",
    "run_group_pass",
    "withdraw_group",
]

#: What a request over several limiters that may park ends with.
SeveralAdmission = tuple[Lease, ...] | Parked | Duplicate

#: How often a process waiting on several limiters runs its request's group pass
#: itself (seconds), besides the passes releasers run when they find it first in line.
GROUP_PASS_S = 1.0


class PostgresConcurrencyLimiter(Protocol):
    """What a request over several limiters uses of each of its PostgreSQL limiters
    (:class:`~runcell_celery.postgres.limiter.PostgresConcurrencyLimiter`): its database,
    waiting room, calls and leases. A protocol, so this module never imports the
    limiter's (which imports it)."""

    @property
    def name(self) -> str: ...

    @property
    def database(self) -> Database: ...

    @property
    def room(self) -> WaitRoom: ...

    @property
    def stored_hash(self) -> str: ...

    def use_stored_limits(self, request: AcquireRequest | None = None) -> bool: ...

    def call_request(
        self,
        request: AcquireRequest,
        query: LiteralString,
        params: Any,
        *,
        lock_ms: int,
        stamp: Stamp | None = None,
    ) -> Any: ...

    def call_database(self, query: LiteralString, params: Any) -> Any: ...

    def republish(self, lease_ids: Any) -> None: ...

    def make_lease(
        self,
        request_id: str,
        workload: str,
        lease: Sequence[Any],
        sent: float | None,
        *,
        waited_ms: float | None = None,
    ) -> Lease: ...

    def granted_lease(self, request_id: str, workload: str, grant: Grant, sent: float) -> Lease: ...

    def reap(self) -> None: ...

    def _cancelled(self, request: AcquireRequest) -> ConcurrencyCancelledError: ...

    def _wait_ms(self, request: AcquireRequest, workload: str) -> float | None: ...

    def _queue_full(self, request: AcquireRequest) -> ConcurrencyQueueFullError: ...

    def _timed_out(
        self, request: AcquireRequest, wait_ms: float | None
    ) -> ConcurrencyTimeoutError: ...


def member_id(group_id: str, limiter: str) -> str:
    """The queue row and lease request id of a request's slot in one limiter."""
    return f"{group_id}|{limiter}"


def acquire_several(
    first: PostgresConcurrencyLimiter,
    limiters: Sequence[ConcurrencyLimiter],
    requests: Sequence[AcquireRequest],
    *,
    cancel: CancellationToken | None = None,
    on_wait: OnWait | None = None,
    park: ParkRule | None = None,
) -> SeveralAdmission:
    """Wait for one slot in every limiter, granted together; see
    :class:`~runcell_celery.protocol.SupportsSeveral`. With ``park`` (admission
    deferral) the request parks as one when the rule says so (see
    :meth:`~.limiter.PostgresConcurrencyLimiter.acquire_several_or_park`)."""
    own = _own_limiters(first, limiters)
    order = sorted(range(len(own)), key=lambda i: own[i].name)
    group = _Group(first, [own[i] for i in order], [requests[i] for i in order], cancel)
    result = group.acquire(on_wait, park=park)
    if isinstance(result, Parked | Duplicate):
        return result
    return _in_callers_order(own, result)


def claim_parked_group(
    first: PostgresConcurrencyLimiter,
    limiters: Sequence[ConcurrencyLimiter],
    group_id: str,
    publication_id: str,
) -> tuple[Lease, ...] | ClaimMiss:
    """Take every lease granted to a parked request over ``limiters``, from its
    re-published message ``publication_id``: all of them, or none (see
    ``runcell_claim_parked_group_v5``), each carrying the request's whole wait
    (``waited_ms``, from its first ask). A retry after a lost reply gets the same answer.
    """
    own = _own_limiters(first, limiters)
    ordered = sorted(own, key=lambda x: x.name)
    params = {
        "group_id": group_id,
        "limiters": [x.name for x in ordered],
        "publication_id": publication_id,
        "op_id": str(uuid.uuid4()),
    }
    sent = time.monotonic()  # before any attempt: the leases are renewed after it
    answer = first.call_database(statements.CLAIM_PARKED_GROUP, params)
    status = answer["s"]
    if status != "claimed":
        return "stale" if status == "stale" else "missing"
    waited = answer.get("waited_ms")  # the whole wait, from the first ask (database time)
    leases = tuple(
        limiter.make_lease(
            member_id(group_id, limiter.name),
            str(workload),
            (lease, token),
            sent,
            waited_ms=None if waited is None else float(waited),
        )
        for limiter, (lease, token, workload) in zip(ordered, answer["leases"], strict=True)
    )
    return _in_callers_order(own, leases)


def withdraw_group(
    first: PostgresConcurrencyLimiter, limiters: Sequence[ConcurrencyLimiter], group_id: str
) -> None:
    """Give up a request's places (or unclaimed parked grants) in every limiter."""
    own = sorted(_own_limiters(first, limiters), key=lambda x: x.name)
    params = {"group_id": group_id, "limiters": [x.name for x in own], "give_back": True}
    answer = first.call_database(statements.WITHDRAW_GROUP, params)
    first.republish(answer.get("parked"))


def _own_limiters(
    first: PostgresConcurrencyLimiter, limiters: Sequence[ConcurrencyLimiter]
) -> list[PostgresConcurrencyLimiter]:
    """``limiters`` as this database's limiters (of ``first``'s class), or a
    configuration error."""
    names = [getattr(limiter, "name", repr(limiter)) for limiter in limiters]
    own: list[PostgresConcurrencyLimiter] = [x for x in limiters if isinstance(x, type(first))]
    conninfo = first.database.conninfo
    if len(own) != len(limiters) or any(x.database.conninfo != conninfo for x in own):
        raise ConcurrencyConfigError(
            "limiters " + ", ".join(repr(n) for n in names) + " cannot be held together: "
            "several PostgreSQL limiters in one slot must share one database",
            limiter=first.name,
        )
    if len(set(names)) != len(names):
        raise ConcurrencyConfigError(
            f"limiters {names!r} name one limiter twice", limiter=first.name
        )
    return own


def _in_callers_order(
    limiters: Sequence[PostgresConcurrencyLimiter], leases: Sequence[Lease]
) -> tuple[Lease, ...]:
    by_name = {lease.limiter: lease for lease in leases}
    return tuple(by_name[limiter.name] for limiter in limiters)


def _lines(lines: Sequence[Any] | None) -> list[WaitEstimate] | None:
    """The ``"lines"`` of :data:`~.statements.ACQUIRE_SEVERAL_WITH_LINES`' answer, or
    ``None`` if one is missing (a limiter row not found). A retried ask that found its
    rows already waiting counts itself in each line (rare: a lost reply)."""
    if not lines or any(line is None or line[0] is None for line in lines):
        return None
    return [
        WaitEstimate(
            ahead=int(ahead),
            hold_ms=float(hold_ms) if hold_ms is not None else None,
            slots=int(slots or 0),
        )
        for ahead, hold_ms, slots in lines
    ]


def run_group_pass(limiter: PostgresConcurrencyLimiter, group_id: str) -> None:
    """Run one request's group pass and wake this process's members it granted."""
    answer = limiter.call_database(statements.ALLOCATE_GROUP, {"group_id": group_id})
    _group_passed(limiter, answer)


def _group_passed(limiter: PostgresConcurrencyLimiter, answer: Any) -> None:
    """Act on a group pass's answer: wake the members it granted, re-publish a parked
    request's task."""
    if answer and answer.get("g"):
        limiter.room.dispatch_grants(answer["t"], answer["g"])
    if answer and answer.get("parked"):  # a parked request: re-publish its task
        limiter.republish(answer["parked"])


class _Group:
    """One request over several limiters while it is asked for and waits."""

    def __init__(
        self,
        first: PostgresConcurrencyLimiter,
        limiters: list[PostgresConcurrencyLimiter],
        requests: list[AcquireRequest],
        cancel: CancellationToken | None,
    ) -> None:
        self.first = first
        self.limiters = limiters
        self.requests = requests
        self.cancel = cancel
        lead = requests[0]
        self.lead = lead
        self.group_id = lead.request_id
        self.members = [member_id(self.group_id, x.name) for x in limiters]
        # Each request carries the workload resolved for its limiter (build_several).
        waits = [x._wait_ms(r, r.workload) for x, r in zip(limiters, requests, strict=True)]
        given = [w for w in waits if w is not None]
        self.wait_ms = min(given) if given else None
        self.deadline = Deadline.after_ms(self.wait_ms) if self.wait_ms is not None else None
        self.sent = time.monotonic()
        self.waiters: list[Waiter] = []
        #: Nothing is left in the database for this request but what it returned (or
        #: what this process's room withdraws in the background): no withdrawal on the
        #: way out.
        self.settled = False
        #: How many times it took the stored limits (``on_conflict="use_stored"``).
        self.adopted = 0
        #: Whether the first ask also reads where it joins each line (for a wait span).
        self.with_lines = False
        #: Where it joined each line, in ``limiters``' order, when it asked for that.
        self.lines: list[WaitEstimate] | None = None

    # -- the whole wait -------------------------------------------------------------------

    def acquire(self, on_wait: OnWait | None, *, park: ParkRule | None) -> SeveralAdmission:
        room = self.first.room
        self.waiters = [
            room.add(member, limiter.name, None, reap=limiter.reap)
            for member, limiter in zip(self.members, self.limiters, strict=True)
        ]
        unlinks = [self.cancel.add_callback(w.wake) for w in self.waiters] if self.cancel else []
        try:
            if self.cancel is not None and self.cancel.is_set():
                self.settled = True
                raise self.first._cancelled(self.lead)
            # A deferrable request may have been written already (a lost reply): ask
            # as a retry, which also finds a parked grant that is not its to take.
            self.with_lines = wants_place(on_wait)
            leases = self._ask(retry=park is not None)
            self.with_lines = False
            if leases is not None:
                self.settled = True
                return leases
            deadline = self.deadline.to_unix() if self.deadline is not None else None
            announce_wait(on_wait, deadline, self._place)
            last_pass = time.monotonic()
            while True:
                if all(w.grant is not None for w in self.waiters):
                    self.settled = True
                    return self._granted()
                if self.cancel is not None and self.cancel.is_set():
                    self.settled = True
                    self._withdraw_in_time(give_back=True)
                    raise self.first._cancelled(self.lead)
                if park is not None and park.until.passed():
                    parked = self._park(park)
                    if parked is not None:
                        self.settled = True
                        return parked
                if self.deadline is not None and self.deadline.passed():
                    self.settled = True  # withdrawn now, or in the background
                    leases = self._withdraw_in_time(give_back=False)
                    if leases is not None:
                        return leases  # granted just before the deadline: the grant wins
                    raise self.first._timed_out(self.lead, self.wait_ms)
                if any(w.missing for w in self.waiters):
                    # Our rows were dropped (this process stalled past
                    # queue_entry_ttl_ms): ask again, as a retry.
                    for waiter in self.waiters:
                        waiter.missing = False
                        waiter.queued = False
                    leases = self._ask(retry=True)
                    if leases is not None:
                        self.settled = True
                        return leases
                if time.monotonic() - last_pass >= GROUP_PASS_S:
                    self._group_pass()
                    last_pass = time.monotonic()
                    continue
                pause = GROUP_PASS_S - (time.monotonic() - last_pass)
                if self.deadline is not None:
                    pause = min(pause, max(0.0, self.deadline.remaining_s()))
                if park is not None:
                    pause = min(pause, max(0.0, park.until.remaining_s()))
                next(w for w in self.waiters if w.grant is None).wait(max(0.0, pause))
        finally:
            for unlink in unlinks:
                unlink()
            for waiter in self.waiters:
                room.remove(waiter)
            if not self.settled:
                # Interrupted or failed: leave every line; slots granted meanwhile are
                # given back, never leaked.
                self._withdraw_quietly()

    # -- round trips ----------------------------------------------------------------------

    def _ask(self, *, retry: bool) -> tuple[Lease, ...] | Duplicate | None:
        """Send the acquire; the leases when granted at once, ``None`` when it waits,
        :class:`~runcell_celery.ports.Duplicate` when a retry finds it parked and
                granted (its own re-published message carries it)."""
        lead = self.lead
        lineage = lead.lineage
        # Whether the request may be in the database already: then leaving means
        # withdrawing it (a row lock that timed out wrote nothing).
        written = retry
        params: dict[str, Any] = {
            "limiters": [x.name for x in self.limiters],
            "hashes": [x.stored_hash for x in self.limiters],
            "workloads": [r.workload for r in self.requests],
            "request": json.dumps(
                {
                    "request_id": self.group_id,
                    "run_id": lineage.run_id,
                    "root_run_id": lineage.root_run_id,
                    "parent_run_id": lineage.parent_run_id,
                    "holder_name": lead.holder_name,
                    "in_progress": lead.in_progress,
                    "key": lead.key,
                }
            ),
            "process": json.dumps(self.first.room.process()),
            "retry": retry,
        }
        while True:
            remaining = None if self.deadline is None else max(0.0, self.deadline.remaining_ms())
            params["wait_ms"] = remaining
            sent = Stamp()
            try:
                answer = self.first.call_request(
                    lead,
                    statements.ACQUIRE_SEVERAL_WITH_LINES
                    if self.with_lines
                    else statements.ACQUIRE_SEVERAL,
                    params,
                    lock_ms=lock_timeout_ms(remaining),
                    stamp=sent,
                )
                break
            except RowBusyError as exc:
                written = written or exc.maybe_done
                params["retry"] = True
                if self.deadline is not None and self.deadline.passed():
                    self.settled = True
                    if written:
                        self._withdraw_in_time(give_back=True)
                    raise self.first._timed_out(lead, self.wait_ms) from None
            except ConcurrencyConfigError as exc:
                # Another worker replaced some limiter's limits: under
                # on_conflict="use_stored" each takes its stored limits and we ask again.
                if not self._use_stored_limits(exc):
                    raise
                params["hashes"] = [x.stored_hash for x in self.limiters]
        self.first.room.clock.sample(sent.at, float(answer["now"]))
        status = answer["s"]
        if status == "granted":
            return self._leases(answer["leases"], sent.at)
        if status == "duplicate":
            return Duplicate()
        if status == "queued":
            for waiter in self.waiters:
                waiter.queued = True
            if "lines" in answer:
                self.lines = _lines(answer["lines"])
            # Others of its lines wait ahead of it, but they may all be requests over
            # several limiters waiting elsewhere: its group pass tells at once.
            with contextlib.suppress(ConcurrencyError):
                self._group_pass()
            return None
        named = self._limiter(answer.get("limiter"))
        self.settled = True  # refused: nothing of it is left in the database
        if status == "queue-full":
            raise named._queue_full(self._request(named))
        if status == "no-wait":
            raise self.first._timed_out(lead, self.wait_ms)
        raise ConcurrencyConfigError(
            f"limiter {named.name!r} has no workload {self._request(named).workload!r}",
            limiter=named.name,
        )

    def _place(self) -> QueuePlace | None:
        """Its place: the largest of its lines' (it is granted when every line lets it
        through), with the longest expected wait when every line has one."""
        lines = self.lines
        if not lines:
            return None
        expected = [line.expected_ms for line in lines]
        known = [ms for ms in expected if ms is not None]
        return QueuePlace(
            place=max(line.place for line in lines),
            expected_wait_ms=max(known) if len(known) == len(expected) else None,
        )

    def _use_stored_limits(self, exc: ConcurrencyConfigError) -> bool:
        """Whether ``exc`` said the limits were replaced and every limiter took the
        stored ones (``on_conflict="use_stored"``), at most a few times per request."""
        if not isinstance(exc.__cause__, LimitsReplacedError) or self.adopted >= 3:
            return False
        self.adopted += 1
        return all(x.use_stored_limits(self.lead) for x in self.limiters)

    def _park(self, park: ParkRule) -> tuple[Lease, ...] | Parked | None:
        """Park the waiting request as one (every member keeps its place); ``None`` when
        not all of it waits any more: the loop then asks again, as a retry."""
        params = {
            "group_id": self.group_id,
            "limiters": [x.name for x in self.limiters],
            "payload": park.payload,
            "broker": park.broker,
            # Made once: a retry after a lost reply gets the first attempt's answer.
            "op_id": str(uuid.uuid4()),
        }
        answer = self.first.call_request(
            self.lead, statements.PARK_GROUP, params, lock_ms=lock_timeout_ms(None)
        )
        if answer["s"] == "parked":
            return Parked(
                limiter=" + ".join(x.name for x in self.limiters),
                workload=self.lead.workload,
                waited_ms=(time.monotonic() - self.sent) * 1000,
            )
        if answer["s"] == "granted":
            return self._leases(answer["leases"], None)
        for waiter in self.waiters:
            waiter.missing = True
        return None

    def _group_pass(self) -> None:
        """Run its group pass, waiting for its limiters' rows no longer than its budget
        (rows that stay locked: the next pass tries again)."""
        remaining = None if self.deadline is None else max(0.0, self.deadline.remaining_ms())
        try:
            answer = self.first.call_request(
                self.lead,
                statements.ALLOCATE_GROUP,
                {"group_id": self.group_id},
                lock_ms=lock_timeout_ms(remaining),
            )
        except RowBusyError:
            return
        _group_passed(self.first, answer)

    def _withdraw(self, *, give_back: bool, lock_ms: int | None = None) -> tuple[Lease, ...] | None:
        params = {
            "group_id": self.group_id,
            "limiters": [x.name for x in self.limiters],
            "give_back": give_back,
        }
        answer = self.first.call_request(
            self.lead,
            statements.WITHDRAW_GROUP,
            params,
            lock_ms=lock_timeout_ms(None) if lock_ms is None else lock_ms,
        )
        if answer["s"] == "granted":
            return self._leases(answer["leases"], None)
        self.first.republish(answer.get("parked"))
        return None

    def _withdraw_in_time(self, *, give_back: bool) -> tuple[Lease, ...] | None:
        """Withdraw it now, waiting for its rows at most
        :data:`~.calls.WITHDRAW_GRACE_MS` (a grant made just before is returned unless
        ``give_back``); rows locked longer: this process's room withdraws it later,
        giving back any grant, and ``None``."""
        try:
            return self._withdraw(give_back=give_back, lock_ms=WITHDRAW_GRACE_MS)
        except RowBusyError:
            self.first.room.withdraw_later(functools.partial(self._withdraw, give_back=True))
            return None

    def _withdraw_quietly(self) -> None:
        # A failure leaves rows the database drops with this process later.
        with contextlib.suppress(Exception):
            self._withdraw(give_back=True)

    # -- leases ---------------------------------------------------------------------------

    def _leases(self, pairs: Sequence[Any], sent: float | None) -> tuple[Lease, ...]:
        return tuple(
            limiter.make_lease(member, request.workload, pair, sent)
            for limiter, request, member, pair in zip(
                self.limiters, self.requests, self.members, pairs, strict=True
            )
        )

    def _granted(self) -> tuple[Lease, ...]:
        out = []
        for limiter, request, waiter in zip(
            self.limiters, self.requests, self.waiters, strict=True
        ):
            grant = waiter.grant
            assert grant is not None
            out.append(limiter.granted_lease(waiter.request_id, request.workload, grant, self.sent))
        return tuple(out)

    def _limiter(self, name: object) -> PostgresConcurrencyLimiter:
        return next((x for x in self.limiters if x.name == name), self.first)

    def _request(self, limiter: PostgresConcurrencyLimiter) -> AcquireRequest:
        return self.requests[self.limiters.index(limiter)]
