"""Working on the stored limits when this worker's differ (``on_conflict="use_stored"``).

During a rolling change of limits, workers started with the old settings run beside
those started with the new ones. Every allocation checks the stored limits' hash
(``runcell_lock_v3``), so with ``"error"`` or ``"replace"`` an old worker refuses
every acquire once the stored limits changed, and each of its tasks fails. With
``"use_stored"`` it reads the stored limits instead, takes them and their hash as
its own and asks again: every worker still grants by one set of limits, the stored
one, and no task fails. A worker that starts while the stored limits differ from
its settings does the same.

Running on limits other than its settings is worth knowing, so a process says so
once per limiter and change: a warning naming each differing field, and a
``config-error`` event (the admin's events list shows it). The keys of a keyed
limiter count as their keyed limiter: one warning for all of them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..config import LimiterConfig
from ..events import ConcurrencyEvent, emit, has_listeners
from ..keys import config_for_key, split_key_name
from ..protocol import AcquireRequest
from . import statements
from .connection import Connection
from .registration import describe_differences

__all__ = ["StoredLimits", "announce_stored_limits", "read_stored_limits"]

logger = logging.getLogger("runcell_celery.postgres")


@dataclass(frozen=True, slots=True)
class StoredLimits:
    """The limits stored for a limiter and the hash every allocation checks."""

    config: LimiterConfig
    config_hash: str


def read_stored_limits(conn: Connection, name: str) -> StoredLimits | None:
    """The limits stored for limiter ``name`` (``None``: it has no row).

    A key's limits are its keyed limiter's, read from the keyed limiter's row (a key's
    own row is a copy that may be purged while idle), under the key's name
    (:func:`~runcell_celery.keys.config_for_key`).
    """
    parent, key = split_key_name(name)
    if key is not None:
        stored = _read(conn, parent)
        if stored is not None and stored.config.keyed:
            return StoredLimits(config_for_key(stored.config, key), stored.config_hash)
    return _read(conn, name)


def _read(conn: Connection, name: str) -> StoredLimits | None:
    row = conn.execute(statements.READ_STORED_LIMITER, {"name": name}).fetchone()
    if row is None:
        return None
    return StoredLimits(config=LimiterConfig.from_mapping(row[0]), config_hash=str(row[1]))


def announce_stored_limits(
    given: LimiterConfig,
    stored: StoredLimits,
    first_time: Callable[[str, str], bool],
    *,
    request: AcquireRequest | None = None,
) -> str | None:
    """Warn and emit a ``config-error`` event that this process now uses ``stored``
    instead of its settings' limits ``given`` (once per limiter and stored hash).

    :param first_time: says whether ``(limiter, stored hash)`` is new to its engine
        (:meth:`~.engine.Engine.first_time`).

    :param request: the request that found the limits replaced, for the event's run
        lineage (``None`` at startup).
    :returns: the message, or ``None`` when nothing was said (already said, or the
        stored limits are the settings' own again).
    """
    if not given.differences(stored.config):
        return None
    differences = describe_differences(given, stored.config.to_dict())
    limiter = split_key_name(given.name)[0]
    if not first_time(limiter, stored.config_hash):
        return None
    message = (
        f"limiter {limiter!r}: this worker's settings differ from the stored limits "
        f"({differences}); it uses the stored limits (on_conflict='use_stored') until "
        "it is restarted with settings that match them"
    )
    logger.warning("runcell: %s", message)
    if has_listeners():
        lineage = request.lineage if request is not None else None
        emit(
            ConcurrencyEvent(
                type="config-error",
                limiter=given.name,
                workload=request.workload if request is not None else None,
                run_id=lineage.run_id if lineage is not None else None,
                root_run_id=lineage.root_run_id if lineage is not None else None,
                parent_run_id=lineage.parent_run_id if lineage is not None else None,
                request_id=request.request_id if request is not None else None,
                timestamp=time.time(),
                holder_name=request.holder_name if request is not None else None,
                error=message,
            )
        )
    return message
