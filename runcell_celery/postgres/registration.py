"""Stored limits: the first worker stores them, every other worker must agree.

Two workers granting under different limits would break the limit, so a worker whose
limits differ from the stored ones fails at startup naming each field, unless
``on_conflict="replace"`` (its limits replace them) or ``"use_stored"`` (it works on
them). Every allocation checks the stored hash, so during a rolling change of limits
a worker with old settings refuses every acquire, or with ``"use_stored"`` takes the
stored limits and asks again: every worker grants by one set of limits and no task
fails. A process says so once per limiter and change (a warning naming each field and
a ``config-error`` event; a keyed limiter's keys count as one).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from psycopg.types.json import Jsonb

from ..config import LimiterConfig
from ..errors import ConcurrencyConfigError
from ..events import ConcurrencyEvent, emit, has_listeners
from ..keys import config_for_key, key_name_clash, split_key_name
from ..protocol import AcquireRequest
from . import statements
from .calls import LOCK_WAIT_CAP_MS
from .connection import Connection
from .options import OnConflict
from .schema import ensure_schema

logger = logging.getLogger("runcell_celery.postgres")


def config_hash(config: LimiterConfig) -> str:
    """A stable hash of the limits, compared by every allocation."""
    canonical = json.dumps(config.to_dict(), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class StoredLimits:
    """The limits stored for a limiter and the hash every allocation checks."""

    config: LimiterConfig
    config_hash: str


@dataclass(frozen=True, slots=True)
class Stored:
    """What :func:`store_limits` came to."""

    #: With ``on_conflict="use_stored"`` and stored limits that differ: those limits
    #: and their hash (the caller works on them).
    adopted: StoredLimits | None = None
    #: After replacing the limits: what the allocation pass it ran granted
    #: (:data:`~.statements.ALLOCATE_AFTER_NEW_LIMITS`), for the caller to re-publish
    #: parked tasks (``"parked"``) and run group passes (``"grp"``).
    allocated: Mapping[str, Any] | None = None


def store_limits(
    conn: Connection, config: LimiterConfig, *, ensure: bool, on_conflict: OnConflict
) -> Stored:
    """Create the schema if asked, then store ``config`` or check the stored limits;
    replaced limits reach the waiting requests in the same transaction.
    """
    ensure_schema(conn, create=ensure)
    params = {
        "name": config.name,
        "config": Jsonb(config.to_dict()),
        "config_hash": config_hash(config),
    }
    with conn.transaction():
        # Several round trips: a frozen worker must not hold the row for long.
        conn.execute(statements.TRANSACTION_BOUNDS)
        _refuse_a_keys_name(conn, config)
        if conn.execute(statements.REGISTER_LIMITER, params).fetchone() is not None:
            conn.execute(statements.SET_LIMITS, params)
            return Stored()
        stored = conn.execute(statements.STORED_LIMITER, params).fetchone()
        assert stored is not None
        if stored[1] == params["config_hash"]:
            return Stored()
        if on_conflict == "use_stored":
            return Stored(
                adopted=StoredLimits(LimiterConfig.from_mapping(stored[0]), str(stored[1]))
            )
        differences = describe_differences(config, stored[0])
        if on_conflict == "replace":
            conn.execute(statements.REPLACE_LIMITER, params)
            conn.execute(statements.SET_LIMITS, params)
            # A keyed limiter's keys take its new limits (or stop being keys of it).
            conn.execute(statements.SYNC_KEYS, params)
            # Raised room goes to the requests waiting now, not at the next release.
            row = conn.execute(
                statements.ALLOCATE_AFTER_NEW_LIMITS,
                {"name": config.name, "lock_timeout_ms": LOCK_WAIT_CAP_MS},
            ).fetchone()
            logger.warning("runcell: replaced the limits of %r: %s", config.name, differences)
            return Stored(allocated=row[0] if row is not None else None)
        raise ConcurrencyConfigError(
            f"limiter {config.name!r} is stored with different limits: {differences}. "
            "All workers sharing a name must use the same limits: use a new name, "
            "store the new limits with on_conflict='replace' (runcell_sync_limiters "
            "--replace, or celery runcell sync-limiters --replace), or let workers work on "
            "the stored limits with "
            "on_conflict='use_stored'",
            limiter=config.name,
        )


def differing_limits(conn: Connection, configs: Sequence[LimiterConfig]) -> list[tuple[str, str]]:
    """The limiters of ``configs`` stored with other limits, with their differences,
    read without storing or locking anything (a limiter not stored yet differs from nothing).
    """
    found: list[tuple[str, str]] = []
    for config in configs:
        row = conn.execute(statements.READ_STORED_LIMITER, {"name": config.name}).fetchone()
        if row is None or row[1] == config_hash(config):
            continue
        differences = describe_differences(config, row[0]) or "its stored limits differ"
        found.append((config.name, differences))
    return found


def _refuse_a_keys_name(conn: Connection, config: LimiterConfig) -> None:
    """A limiter may not be named like a key of a keyed limiter (``"tenant:acme"`` while
    ``"tenant"`` is keyed): both would be one row. Refused in either order: whichever
    of the two is stored first, the second is refused naming both."""
    if config.keyed:
        # The other order: the keyed limiter comes after a limiter named like its key.
        row = conn.execute(statements.PLAIN_NAMED_LIKE_A_KEY, {"name": config.name}).fetchone()
        if row is not None:
            _, key = split_key_name(str(row[0]))
            raise key_name_clash(str(row[0]), config.name, key or "", stored="limiter")
        return
    parent, key = split_key_name(config.name)
    if key is None:
        return
    if conn.execute(statements.IS_KEYED, {"name": parent}).fetchone() is not None:
        raise key_name_clash(config.name, parent, key, stored="keyed")


def describe_differences(config: LimiterConfig, stored: Mapping[str, Any]) -> str:
    """Name each differing field with the stored and the given value."""
    try:
        theirs = LimiterConfig.from_mapping(stored)
    except ConcurrencyConfigError:
        return f"stored {dict(stored)!r}"
    mine, other = config.to_dict(), theirs.to_dict()
    return "; ".join(
        f"{path} (stored {_dig(other, path)!r}, given {_dig(mine, path)!r})"
        for path in config.differences(theirs)
    )


def _dig(tree: Mapping[str, Any], path: str) -> Any:
    node: Any = tree
    for part in path.split("."):
        node = node.get(part) if isinstance(node, Mapping) else None
    return node


def read_stored_limits(conn: Connection, name: str) -> StoredLimits | None:
    """The limits stored for limiter ``name`` (``None``: no row); a key's are its keyed
    limiter's, under the key's name.
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
) -> None:
    """Warn and emit a ``config-error`` event that this process uses ``stored`` instead
    of ``given``, once per limiter and stored hash (``first_time``). ``request``: the one
    that found the limits replaced.
    """
    if not given.differences(stored.config):
        return
    differences = describe_differences(given, stored.config.to_dict())
    limiter = split_key_name(given.name)[0]
    if not first_time(limiter, stored.config_hash):
        return
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
