"""Keys of a keyed limiter: what a key may be, and the limiter each key gets.

A ``keyed=True`` limiter is a template: each key gets a limiter of its own with the same
limits (``tenant.key("acme")``, named ``"tenant:acme"``), an ordinary limiter to
everything below. Keys and fairness keys come from user data, so they are checked here
once, wherever they enter: the database must never be the first to refuse one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Literal, cast

from .config import KEY_SEPARATOR, MAX_NAME_LENGTH, UNSTORABLE_RULE, LimiterConfig, has_unstorable
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
    """Return ``key`` if it may name a key of ``limiter``, else raise naming it (and
    ``argument``, where it was given)."""
    problem = _key_problem(key) or _room_problem(limiter, str(key))
    if problem is not None:
        where = f"{argument}: " if argument else ""
        raise ConcurrencyConfigError(
            f"{where}key {describe_key(key)} of limiter {limiter!r} is invalid: {problem}",
            limiter=limiter,
        )
    return cast(str, key)


def check_fair_key(key: object, *, argument: str) -> str:
    """Return ``key`` if it may be a fairness key (:func:`check_key`'s rules but the
    name's length: it names no limiter), else raise naming ``argument``."""
    problem = _key_problem(key)
    if problem is not None:
        raise ConcurrencyConfigError(f"{argument} = {describe_key(key)} is invalid: {problem}")
    return cast(str, key)


#: Keys up to this long are shown whole in errors; longer ones by start and length.
_SHOWN_WHOLE = 200


def describe_key(key: object) -> str:
    """The key as an error shows it: whole when short, else its start and length."""
    if not isinstance(key, str):
        shown = repr(key)
        if len(shown) > _SHOWN_WHOLE:
            shown = shown[: _SHOWN_WHOLE - 1] + "\u2026"
        return f"{shown} (of type {type(key).__name__})"
    if len(key) <= _SHOWN_WHOLE:
        return _escaped(key)
    return f"{_escaped(key[:16])}\u2026 ({len(key)} characters)"


def _escaped(text: str) -> str:
    # repr() leaves lone surrogates: escape them so the message can be printed.
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


def _room_problem(limiter: str, key: str) -> str | None:
    room = MAX_NAME_LENGTH - len(limiter) - len(KEY_SEPARATOR)
    if len(key) <= room:
        return None
    return (
        f"with the limiter's name it would make a name longer than {MAX_NAME_LENGTH} "
        f"characters: keys of this limiter may have at most {max(room, 0)}"
    )


def key_limiter_name(limiter: str, key: str) -> str:
    """The name of ``key``'s limiter: ``"tenant:acme"`` (``key`` already checked)."""
    return f"{limiter}{KEY_SEPARATOR}{key}"


def split_key_name(name: str) -> tuple[str, str | None]:
    """``"tenant:acme"`` -> ``("tenant", "acme")``; without a key ``(name, None)``."""
    limiter, separator, key = name.partition(KEY_SEPARATOR)
    return (limiter, key) if separator else (name, None)


def key_name_clash(
    plain: str, keyed: str, key: str, *, stored: Literal["keyed", "limiter"] | None = None
) -> ConcurrencyConfigError:
    """The error for a limiter ``plain`` named like key ``key`` of the keyed limiter
    ``keyed``; ``stored`` says which was in the database first."""
    first = {"keyed": f"the keyed limiter {keyed!r}", "limiter": f"the limiter {plain!r}"}
    there = f" ({first[stored]} is stored already)" if stored else ""
    return ConcurrencyConfigError(
        f"limiter {plain!r} is named like key {key!r} of the keyed limiter {keyed!r}"
        f"{there}: both would be one limiter, so {keyed}.key({key!r}) could never be "
        f"used; rename one of them (the limits of key {key!r} are {keyed}.key({key!r}))",
        limiter=plain,
    )


def check_key_clashes(limiters: Mapping[str, bool], *, where: str = "") -> None:
    """Raise (:func:`key_name_clash`, after ``where``) if one of ``limiters`` (name:
    keyed?) is named like a key of a keyed one."""
    for name, keyed in limiters.items():
        parent, key = split_key_name(name)
        if key is not None and not keyed and limiters.get(parent):
            error = key_name_clash(name, parent, key)
            if where:
                raise ConcurrencyConfigError(f"{where}: {error.message}", limiter=name)
            raise error


def config_for_key(config: LimiterConfig, key: str) -> LimiterConfig:
    """The limits of ``key``'s limiter: the keyed limiter's, under the key's name."""
    if not config.keyed:
        raise ConcurrencyConfigError(
            f"limiter {config.name!r} is not keyed: declare it with keyed=True to give "
            "each key its own limit",
            limiter=config.name,
        )
    check_key(config.name, key)
    return dataclasses.replace(config, name=key_limiter_name(config.name, key), keyed=False)


def is_keyed(limiter: object) -> bool:
    """Whether ``limiter`` is a keyed template: as its limits say when it has them (a
    PostgreSQL limiter always has ``key()``), else whether it has keys."""
    config = getattr(limiter, "config", None)
    if isinstance(config, LimiterConfig):
        return config.keyed
    return supports(limiter, SupportsKeys)
