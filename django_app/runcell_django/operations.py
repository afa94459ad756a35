"""What an operator may do to live state: force the release of stuck leases."""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass

from django.db import connections, router, transaction
from django.utils import timezone

from runcell_celery import LimiterConfig
from runcell_celery.postgres import PostgresConcurrencyLimiter
from runcell_celery.postgres.connection import Database

from . import conf, sql
from .models import FORCE_RELEASED, ConcurrencyEvent, Lease, Limiter

__all__ = ["ReleasedLease", "force_release"]

logger = logging.getLogger("runcell_django.operations")


@dataclass(frozen=True, slots=True)
class ReleasedLease:
    lease_id: str
    limiter: str
    workload: str
    request_id: str
    fencing_token: int
    run_id: str | None
    root_run_id: str | None
    parent_run_id: str | None
    holder_name: str | None


def force_release(lease_ids: Sequence[str], *, actor: str) -> list[ReleasedLease]:
    """Take slots back from their holders now and give them to the next waiters.

    The leases are expired (database time) and each limiter runs an allocation pass,
    exactly as when a crashed holder's lease runs out: a parked task's grant goes back
    in line, waiters are granted by the allocation rules. The holder finds out at its
    next renewal (within a third of the lease TTL) and its provider call is aborted
    with ``ConcurrencyLeaseLostError``; until then its call may still run, so the
    fencing token is what protects the provider. Each release is recorded as a
    ``force-released`` event naming ``actor``.

    :returns: the leases released (those already gone are left out).
    """
    alias = conf.database_alias() or router.db_for_write(Lease)
    with transaction.atomic(using=alias):
        with connections[alias].cursor() as cursor:
            cursor.execute(sql.EXPIRE_LEASES, {"lease_ids": [str(i) for i in lease_ids]})
            released = [ReleasedLease(*row) for row in cursor.fetchall()]
        now = timezone.now()
        ConcurrencyEvent.objects.using(alias).bulk_create(
            ConcurrencyEvent(
                type=FORCE_RELEASED,
                occurred_at=now,
                limiter=lease.limiter,
                workload=lease.workload,
                run_id=lease.run_id,
                root_run_id=lease.root_run_id,
                parent_run_id=lease.parent_run_id,
                request_id=lease.request_id,
                holder_name=lease.holder_name,
                lease_id=lease.lease_id,
                fencing_token=lease.fencing_token,
                host=socket.gethostname()[:255],
                pid=os.getpid(),
                actor=actor[:150],
            )
            for lease in released
        )
        limiters = sorted({lease.limiter for lease in released})
        transaction.on_commit(lambda: _reap(alias, limiters), using=alias)
    for lease in released:
        logger.warning(
            "runcell: %s force-released lease %s of %s/%s (run %s, token %s)",
            actor,
            lease.lease_id,
            lease.limiter,
            lease.workload,
            lease.run_id,
            lease.fencing_token,
        )
    return released


def _reap(alias: str, names: Sequence[str]) -> None:
    """Run an allocation pass on each limiter with its stored limits.

    Any worker's next allocation would do it too; doing it now hands the freed slots
    to waiters at once. A limiter made from the stored limits needs no settings.
    """
    if not names:
        return
    # The process's shared pool for this DSN (the one its limiters use).
    database = Database(conf.resolve_database(alias))
    for row in Limiter.objects.using(alias).filter(name__in=names):
        try:
            config = LimiterConfig.from_mapping(row.config)
            PostgresConcurrencyLimiter(database, config, listen=False).reap()
        except Exception:
            logger.exception("runcell: reaping %r after a force release failed", row.name)
