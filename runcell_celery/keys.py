"""Keys of a keyed limiter: what a key may be, and the limiter each key gets.

A limiter declared ``keyed=True`` (``create_concurrency_limiter(2, name="tenant",
keyed=True)``) is a template: every key (a tenant, an API key, a user) gets a limiter
of its own with the same limits, ``tenant.key("acme")``, so one customer's batch cannot
take another customer's slots. To everything below the factories — allocation, the
waiting room, the database — a key's limiter is an ordinary limiter whose name is the
keyed limiter's name, ``":"``, and the key (``"tenant:acme"``); its state appears on
first use and is removed once idle, so 100,000 tenants leave nothing behind.

Keys come from user data (a task argument, a header), so they are checked here, in one
place, before they name anything: a string of 1 to :data:`MAX_KEY_LENGTH` characters,
not blank, with no control characters (NUL among them) and no lone surrogates (neither
can be stored in PostgreSQL's ``text``), whose limiter name stays within
:data:`~runcell_celery.config.MAX_NAME_LENGTH`. A fairness key (``slot(key=...)``,
``run(key=...)``, a task's key, the ``runcell_key`` header) follows the same rules
(:func:`check_fair_key`) wherever it enters, so the database is never the first to
refuse one: a key it cannot index would fail every allocation that grants it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Literal

from .config import (
    KEY_SEPARATOR,
    MAX_NAME_LENGTH,
    UNSTORABLE_RULE,
    LimiterConfig,
    has_unstorable,
)
from .errors import ConcurrencyConfigError
from .protocol import SupportsKeys, supports

__all__ = [
    "MAX_KEY_LENGTH",
    "check_fair_key",
    "check_key",
    "check_key_clashes",
    "config_for_key",
    "describe_key",
    "is_keyed",
    "key_limiter_name",
    "key_name_clash",
    "split_key_name",
]

#: The longest key, in characters.
MAX_KEY_LENGTH = 128


def check_key(limiter: str, key: object, *, argument: str | None = None) -> str:
    """Return ``key`` if it may name a key of ``limiter``; raise naming it otherwise.

    :param argument: where the key was given (``"tenant.key(...)"``), for the message.
    :raises ConcurrencyConfigError: not a string, blank, longer than
        :data:`MAX_KEY_LENGTH`, containing a control character or a lone surrogate,
        or making the key's limiter name longer than
        :data:`~runcell_celery.config.MAX_NAME_LENGTH`.
    """
    problem = _key_problem(key) or _room_problem(limiter, key)
    if problem is not None:
        where = f"{argument}: " if argument else ""
        raise ConcurrencyConfigError(
            f"{where}key {describe_key(key)} of limiter {limiter!r} is invalid: {problem}",
            limiter=limiter,
        )
    assert isinstance(key, str)
    return key


def check_fair_key(key: object, *, argument: str) -> str:
    """Return ``key`` if it may be a request's fairness key; raise naming ``argument``.

    The rules of :func:`check_key` but the name's length: a fairness key names no
    limiter (it groups waiting requests of ``fairness: "round_robin"`` limiters).

    :raises ConcurrencyConfigError: ``{argument} = <the key's shape> is invalid: ...``.
    """
    problem = _key_problem(key)
    if problem is not None:
        raise ConcurrencyConfigError(f"{argument} = {describe_key(key)} is invalid: {problem}")
    assert isinstance(key, str)
    return key


#: Keys up to this long are shown whole in errors (one just past the 128-character
#: limit too, so its author sees it); longer ones by their start and length.
_SHOWN_WHOLE = 200


def describe_key(key: object) -> str:
    """The key as an error shows it: whole when short, else its start and its length
    (a 3,000-character key is not printed whole), control characters escaped."""
    if not isinstance(key, str):
        shown = repr(key)
        if len(shown) > _SHOWN_WHOLE:
            shown = shown[: _SHOWN_WHOLE - 1] + "\u2026"
        return f"{shown} (of type {type(key).__name__})"
    if len(key) <= _SHOWN_WHOLE:
        return _escaped(key)
    return f"{_escaped(key[:16])}\u2026 ({len(key)} characters)"


def _escaped(text: str) -> str:
    # repr() escapes control characters but not lone surrogates' invalidity: make
    # them visible too, so the message itself can be printed and stored.
    return repr(text).encode("utf-8", "backslashreplace").decode("utf-8")


def _key_problem(key: object) -> str | None:
    if not isinstance(key, str):
        return f"a key must be a string, not {type(key).__name__}"
    if not key.strip():
        return "a key must not be empty or blank"
    if len(key) > MAX_KEY_LENGTH:
        return f"a key must be at most {MAX_KEY_LENGTH} characters (it has {len(key)})"
    if has_unstorable(key):
        return f"a key must not contain {UNSTORABLE_RULE}"
    return None


def _room_problem(limiter: str, key: object) -> str | None:
    assert isinstance(key, str)
    room = MAX_NAME_LENGTH - len(limiter) - len(KEY_SEPARATOR)
    if len(key) > room:
        return (
            f"with the limiter's name it would make a name longer than {MAX_NAME_LENGTH} "
            f"characters: keys of this limiter may have at most {max(room, 0)}"
        )
    return None


def key_limiter_name(limiter: str, key: str) -> str:
    """The name of ``key``'s limiter: ``"tenant:acme"`` (``key`` already checked)."""
    return f"{limiter}{KEY_SEPARATOR}{key}"


def split_key_name(name: str) -> tuple[str, str | None]:
    """``"tenant:acme"`` -> ``("tenant", "acme")``; a name without a key -> ``(name, None)``.

    A keyed limiter's own name never contains the separator, so the first one splits.
    """
    limiter, separator, key = name.partition(KEY_SEPARATOR)
    return (limiter, key) if separator else (name, None)


def key_name_clash(
    plain: str, keyed: str, key: str, *, stored: Literal["keyed", "limiter"] | None = None
) -> ConcurrencyConfigError:
    """The error for a limiter ``plain`` named like key ``key`` of the keyed limiter
    ``keyed`` (``"tenant:acme"`` and ``"tenant"``): both would be one limiter.

    :param stored: which of the two was there first, when it is in the database.
    """
    there = ""
    if stored == "keyed":
        there = f" (the keyed limiter {keyed!r} is stored already)"
    elif stored == "limiter":
        there = f" (the limiter {plain!r} is stored already)"
    return ConcurrencyConfigError(
        f"limiter {plain!r} is named like key {key!r} of the keyed limiter {keyed!r}"
        f"{there}: both would be one limiter, so {keyed}.key({key!r}) could never be "
        f"used; rename one of them (the limits of key {key!r} are {keyed}.key({key!r}))",
        limiter=plain,
    )


def check_key_clashes(limiters: Mapping[str, bool], *, where: str = "") -> None:
    """Raise if a limiter is named like a key of a keyed one, in either order.

    :param limiters: every limiter's name, with whether it is keyed.
    :param where: where they were given (``RUNCELL["LIMITERS"]``), for the message.
    :raises ConcurrencyConfigError: naming both limiters (:func:`key_name_clash`).
    """
    for name, keyed in limiters.items():
        parent, key = split_key_name(name)
        if key is not None and not keyed and limiters.get(parent):
            error = key_name_clash(name, parent, key)
            if where:
                raise ConcurrencyConfigError(f"{where}: {error.message}", limiter=name)
            raise error


def config_for_key(config: LimiterConfig, key: str) -> LimiterConfig:
    """The limits of ``key``'s limiter: the keyed limiter's, under the key's name.

    :raises ConcurrencyConfigError: ``config`` is not keyed, or ``key`` is invalid.
    """
    if not config.keyed:
        raise ConcurrencyConfigError(
            f"limiter {config.name!r} is not keyed: declare it with keyed=True to give "
            "each key its own limit",
            limiter=config.name,
        )
    check_key(config.name, key)
    return dataclasses.replace(config, name=key_limiter_name(config.name, key), keyed=False)


def is_keyed(limiter: object) -> bool:
    """Whether ``limiter`` is a keyed limiter itself (a template whose slots are taken on
    its keys). Its limits say so when it has them (a PostgreSQL limiter has ``key()``
    whether or not it is keyed); otherwise, having keys (:class:`SupportsKeys`) does."""
    config = getattr(limiter, "config", None)
    if isinstance(config, LimiterConfig):
        return config.keyed
    return supports(limiter, SupportsKeys)
