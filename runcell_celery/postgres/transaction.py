"""One allocation transaction: lock the limiter row, decide with ``allocate``, write.

Two round trips, both sent as one simple-query message with client-side binding:

1. ``BEGIN`` + ``runcell_lock_v2``: take the limiter row's lock, apply a release or a
   withdrawal, reap what expired, read the slots held per workload and the oldest
   waiters;
2. ``runcell_apply_v2`` + ``COMMIT``: write the decision (leases with fencing
   tokens, the caller's queue row), notifying processes whose waiters were granted.

Between them :func:`runcell_celery.allocation.allocate` decides in Python — the same
function the in-memory limiter uses — so the row lock is held for one round trip plus
that decision. Measured here, this is faster than psycopg's pipeline mode.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import psycopg
from psycopg.types.json import Jsonb

from ..allocation import allocate
from ..config import LimiterConfig
from ..errors import ConcurrencyConfigError, ConcurrencyLimiterError
from ..protocol import AcquireRequest, Lease
from . import statements
from .connection import Connection

__all__ = ["Caller", "Decision", "allocation_transaction", "lock_and_commit", "would_grant"]

_HOST = socket.gethostname()


@dataclass(frozen=True, slots=True)
class _Waiting:
    request_id: str
    workload: str
    in_progress: bool = False


@dataclass(frozen=True, slots=True)
class Caller:
    """The request asking for a slot in this transaction (``None`` for a pass)."""

    request: AcquireRequest
    workload: str
    wait_ms: float | None

    def row(self) -> dict[str, Any]:
        """The queue/lease row fields, with the holder this process is."""
        lineage = self.request.lineage
        return {
            "request_id": self.request.request_id,
            "workload": self.workload,
            "run_id": lineage.run_id,
            "root_run_id": lineage.root_run_id,
            "parent_run_id": lineage.parent_run_id,
            "holder_name": self.request.holder_name,
            "holder_host": _HOST,
            "holder_pid": os.getpid(),
            "wait_ms": self.wait_ms,
            "in_progress": self.request.in_progress,
        }


@dataclass(slots=True)
class Decision:
    """What one allocation transaction did for its caller."""

    lease: Lease | None = None
    queued: bool = False
    #: How long the caller may wait in the queue, in ms measured by the database when
    #: it answered (``None``: no limit). A duration, so no host clock is involved.
    wait_ms_left: float | None = None
    refused: Literal["queue-full", "no-wait"] | None = None
    #: The request already has a lease granted while it was parked: it belongs to
    #: the task's re-published message, not to this caller.
    parked_lease: bool = False
    #: Lease ids this allocation granted to parked requests (to re-publish).
    parked_granted: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Limits:
    """What a transaction needs to know about its limiter."""

    name: str
    config: LimiterConfig
    config_hash: str
    queue_ttl_ms: int

    def lock_params(
        self, *, release: str | None, withdraw: str | None, request_id: str | None
    ) -> dict[str, Any]:
        return {
            "limiter": self.name,
            "release_lease": release,
            "withdraw_request": withdraw,
            "request_id": request_id,
            "max_per_workload": self.config.max_concurrent,
        }

    def lease(self, row: Mapping[str, Any]) -> Lease:
        return Lease(
            lease_id=str(row["lease_id"]),
            limiter=self.name,
            workload=row["workload"],
            request_id=row["request_id"],
            fencing_token=int(row["fencing_token"]),
            ttl_ms=self.config.lease_ttl_ms,
        )

    def check(self, state: dict[str, Any] | None) -> dict[str, Any]:
        """Return the state read under the lock, if this worker may act on it."""
        if state is None:
            raise ConcurrencyLimiterError(
                f"limiter {self.name!r} is not registered in the database "
                "(its row was deleted?); restart the workers to register it",
                limiter=self.name,
            )
        if state["config_hash"] != self.config_hash:
            raise ConcurrencyConfigError(
                f"the limits of limiter {self.name!r} were replaced by another worker; "
                "restart this worker with the new limits",
                limiter=self.name,
            )
        return state


def _waiting(state: Mapping[str, Any]) -> list[_Waiting]:
    return [
        _Waiting(request_id, workload, in_progress)
        for request_id, workload, _position, in_progress in state["waiting"]
    ]


def would_grant(limits: Limits, state: Mapping[str, Any]) -> bool:
    """Tell whether an allocation pass over ``state`` would grant anybody."""
    return bool(allocate(limits.config, state["active"], _waiting(state)))


def lock_and_commit(conn: Connection, params: Mapping[str, Any]) -> Any:
    """A release or withdrawal that needs no decision: one round trip, then commit."""
    cursor = psycopg.ClientCursor(conn)
    try:
        cursor.execute(statements.LOCK_AND_COMMIT, params)
        cursor.nextset()  # past BEGIN's empty result
        row = cursor.fetchone()
    except BaseException:
        _rollback_quietly(conn)
        raise
    return row[0] if row is not None else None


def allocation_transaction(
    conn: Connection, limits: Limits, lock_params: Mapping[str, Any], caller: Caller | None
) -> Decision:
    """Lock, decide with :func:`allocate`, write and commit; return the caller's part."""
    config = limits.config
    decision = Decision()
    cursor = psycopg.ClientCursor(conn)
    try:
        cursor.execute(statements.BEGIN_AND_LOCK, lock_params)
        cursor.nextset()  # past BEGIN's empty result
        row = cursor.fetchone()
        state = limits.check(row[0] if row is not None else None)
        mine = state["mine"]
        if mine is not None:
            # The request is known already (a retry after a lost answer, or another
            # delivery of the same task): keep what it has.
            cursor.execute(statements.COMMIT)
            if "lease" in mine:
                decision.lease = limits.lease(mine["lease"])
            elif "parked_lease" in mine:
                decision.parked_lease = True
            else:
                decision.queued, decision.wait_ms_left = True, mine["queued"]
            return decision
        waiting = _waiting(state)
        if caller is not None:
            waiting.append(
                _Waiting(caller.request.request_id, caller.workload, caller.request.in_progress)
            )
        granted = allocate(config, state["active"], waiting)
        caller_index = len(waiting) - 1 if caller is not None else -1
        grants = [waiting[i].request_id for i in granted if i != caller_index]
        action: str | None = None
        if caller is not None:
            if caller_index in granted:
                action = "grant"
            elif config.max_queued is not None and state["queued"] >= config.max_queued:
                decision.refused = "queue-full"
            elif caller.wait_ms is not None and caller.wait_ms <= 0:
                decision.refused = "no-wait"
            else:
                action = "enqueue"
        if not grants and action is None:
            cursor.execute(statements.COMMIT)
            return decision
        cursor.execute(
            statements.APPLY_AND_COMMIT,
            {
                "limiter": limits.name,
                "grants": Jsonb(grants),
                "caller": Jsonb(caller.row() if caller is not None else None),
                "caller_action": action,
                "ttl_ms": config.lease_ttl_ms,
                "queue_ttl_ms": limits.queue_ttl_ms,
            },
        )
        result = cursor.fetchone()
    except BaseException:
        _rollback_quietly(conn)
        raise
    assert result is not None
    applied = result[0]
    leases = applied["leases"]
    decision.parked_granted = [lease["lease_id"] for lease in leases if lease.get("parked")]
    if caller is not None:
        for lease in leases:
            if lease["request_id"] == caller.request.request_id:
                decision.lease = limits.lease(lease)
        decision.queued = action == "enqueue"
        decision.wait_ms_left = applied["wait_ms_left"]
    return decision


def _rollback_quietly(conn: Connection) -> None:
    if conn.broken or conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE:
        return
    with contextlib.suppress(psycopg.Error):
        conn.rollback()
