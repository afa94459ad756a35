"""Force release: an operator takes stuck slots back, and who did it is recorded.

The release and its ``force-released`` events are
:func:`runcell_celery.postgres.operations.force_release`'s, as for ``celery -A proj
runcell release``: the backend writes both in one statement.
"""

from __future__ import annotations

from collections.abc import Sequence

from runcell_celery.postgres import ReleasedLease, operations

from . import conf


def force_release(lease_ids: Sequence[str], *, actor: str) -> list[ReleasedLease]:
    """Take slots back from their holders now, give them to the next waiters, and record
    a ``force-released`` event naming ``actor`` for each; return the leases released.

    The holder finds out at its next renewal (``ConcurrencyLeaseLostError``); until then
    its call may still run, so the fencing token is what protects the provider.
    """
    return operations.force_release(
        conf.postgres_backend(), [str(i) for i in lease_ids], actor=actor
    )
