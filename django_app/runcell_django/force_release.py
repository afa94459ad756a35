"""Force release: an operator takes stuck slots back, and the app records who did it.

The release itself is the PostgreSQL backend's
(:meth:`runcell_celery.postgres.PostgresBackend.force_release`); this app only writes
its own audit events.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Sequence

from django.db import transaction
from django.utils import timezone

from runcell_celery.postgres import ReleasedLease

from . import conf
from .event_types import FORCE_RELEASED
from .managers import write_alias
from .models import ConcurrencyEvent

logger = logging.getLogger("runcell_django.force_release")


def force_release(lease_ids: Sequence[str], *, actor: str) -> list[ReleasedLease]:
    """Take slots back from their holders now, give them to the next waiters, and record
    a ``force-released`` event naming ``actor`` for each; return the leases released.

    The holder finds out at its next renewal (``ConcurrencyLeaseLostError``); until then
    its call may still run, so the fencing token is what protects the provider.
    """
    released = conf.postgres_backend().force_release([str(i) for i in lease_ids], actor=actor)
    now = timezone.now()
    alias = write_alias(ConcurrencyEvent)
    with transaction.atomic(using=alias):
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
