"""Did-you-mean hints for error messages: one helper, the same words everywhere."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

__all__ = ["did_you_mean"]


def did_you_mean(value: object, choices: Iterable[object], *, label: str = "valid") -> str:
    """``"did you mean 'x'? valid: 'a', 'b'"`` for an unknown ``value`` (``label``: the
    word before the choices; none reads ``none configured``)."""
    options = sorted(str(choice) for choice in choices)
    close = difflib.get_close_matches(str(value), options, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    listed = ", ".join(repr(option) for option in options) or "none configured"
    return f"{hint}{label}: {listed}"
