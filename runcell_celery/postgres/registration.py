"""Stored limits: the first worker stores them, every other worker must agree.

All workers that share a limiter name must apply the same rules, or two of them could
grant slots under different limits. The first worker stores its limits (with a hash)
in the limiter's row; a worker whose limits differ fails at startup with
:class:`~runcell_celery.errors.ConcurrencyConfigError` naming each differing field,
unless it was created with ``on_conflict="replace"`` (its limits replace the stored
ones) or ``on_conflict="use_stored"`` (it works on the stored ones,
:mod:`~.stored_limits`). Every allocation then checks the hash, so a worker left
running with old limits never grants by them: it stops, or with ``"use_stored"``
takes the stored limits.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from psycopg.types.json import Jsonb

from ..config import LimiterConfig
from ..errors import ConcurrencyConfigError
from ..keys import key_name_clash, split_key_name
from . import statements
from .calls import LOCK_WAIT_CAP_MS
from .connection import Connection
from .options import OnConflict
from .schema import ensure_schema

__all__ = ["OnConflict", "Stored", "config_hash", "differing_limits", "store_limits"]

logger = logging.getLogger("runcell_celery.postgres")


def config_hash(config: LimiterConfig) -> str:
    """A stable hash of the limits, compared by every allocation."""
    canonical = json.dumps(config.to_dict(), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Stored:
    """What :func:`store_limits` came to."""

    #: With ``on_conflict="use_stored"`` and stored limits that differ: those limits
    #: and their hash (the caller works on them).
    adopted: tuple[LimiterConfig, str] | None = None
    #: After replacing the limits: what the allocation pass it ran granted
    #: (:data:`~.statements.ALLOCATE_AFTER_NEW_LIMITS`), for the caller to re-publish
    #: parked tasks (``"parked"``) and run group passes (``"grp"``).
    allocated: Mapping[str, Any] | None = None


def store_limits(
    conn: Connection, config: LimiterConfig, *, ensure: bool, on_conflict: OnConflict
) -> Stored:
    """Create the schema if asked, then store ``config`` or check the stored limits.

    Replaced limits reach the requests already waiting at once: the same transaction
    runs allocation on the limiter and on its keys that have waiters.
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
            return Stored(adopted=(LimiterConfig.from_mapping(stored[0]), str(stored[1])))
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
            "--replace), or let workers work on the stored limits with "
            "on_conflict='use_stored'",
            limiter=config.name,
        )


def differing_limits(conn: Connection, configs: Sequence[LimiterConfig]) -> list[tuple[str, str]]:
    """The limiters of ``configs`` stored with other limits, each with its differences
    (:func:`describe_differences`), read without storing or locking anything: what
    :func:`store_limits` would refuse under ``on_conflict="error"``. A limiter not
    stored yet differs from nothing."""
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
