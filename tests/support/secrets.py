"""Where a secret could show: an exception's message, its repr, and those of every
exception chained to it (``__cause__`` and ``__context__``)."""

from __future__ import annotations

import uuid

__all__ = ["everything_shown", "unique_secret"]


def unique_secret(label: str = "pw") -> str:
    """A secret no other text holds by chance (one per test)."""
    return f"{label}{uuid.uuid4().hex[:16]}"


def everything_shown(error: BaseException) -> str:
    """The messages and reprs of ``error`` and of every exception chained to it."""
    seen: list[str] = []
    todo: list[BaseException | None] = [error]
    done: set[int] = set()
    while todo:
        current = todo.pop()
        if current is None or id(current) in done:
            continue
        done.add(id(current))
        seen += [str(current), repr(current), *map(str, current.args)]
        todo += [current.__cause__, current.__context__]
    return "\n".join(seen)
