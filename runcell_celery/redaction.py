"""Say what a secret-bearing value is without saying what it holds.

A ``DATABASE`` DSN, the metrics ``TOKEN`` and whatever is put in their place by mistake
may carry a password: errors, logs and pages show such a value's :func:`shape`, a DSN
only masked (:func:`mask_dsn`), text from psycopg or libpq only :func:`scrub`-bed.
Standard library only: every layer of the package uses it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from urllib.parse import unquote

__all__ = [
    "MASK",
    "MIN_TOKEN_LENGTH",
    "MaskedDSN",
    "TokenError",
    "check_token",
    "dsn_secrets",
    "looks_like_dsn",
    "mask_dsn",
    "scrub",
    "shape",
]

#: What stands where a secret was.
MASK = "***"

#: A metrics token shorter than this is refused: it would be guessed.
MIN_TOKEN_LENGTH = 16

#: ``scheme://user:PASSWORD@host``: the password runs to the last ``@`` of the word
#: (an unescaped ``@`` in a password is masked too, never half shown).
_URL_PASSWORD = re.compile(r"(?P<keep>[A-Za-z][A-Za-z0-9+.-]*://[^:/@\s]*:)(?P<secret>\S*)@")
#: ``password=secret``, ``password = 'a b'``, ``?password=secret&``, ``'PASSWORD': 'x'``,
#: ``"token": "x"`` (a dict's or JSON's repr), with the keys that name a secret.
_KEYED_SECRET = re.compile(
    r"""(?ix)
    (?P<keep>\b(?:password|passwd|pwd|passfile|secret|token|api[_-]?key)['"]?\s*[=:]\s*)
    (?P<secret>'(?:[^'\\]|\\.)*'?|"(?:[^"\\]|\\.)*"?|[^\s&,;)}\]]+)
    """
)


def shape(value: object) -> str:
    """Describe ``value`` by its type and size, never its content (``"a str of 31
    characters"``); a mapping's keys are names, not secrets, and are shown."""
    if value is None or isinstance(value, bool):
        return repr(value)
    if isinstance(value, str):
        return f"a str of {len(value)} characters"
    if isinstance(value, bytes | bytearray | memoryview):
        return f"{type(value).__name__} ({len(value)} bytes)"
    if isinstance(value, Mapping):
        keys = ", ".join(repr(k) if isinstance(k, str) else shape(k) for k in list(value)[:10])
        more = ", ..." if len(value) > 10 else ""
        return f"a {type(value).__name__} with keys {keys}{more}" if keys else "an empty dict"
    if isinstance(value, list | tuple | set | frozenset):
        count = len(value)
        return f"a {type(value).__name__} of {count} item{'' if count == 1 else 's'}"
    if isinstance(value, int | float):
        return f"a number ({type(value).__name__})"
    name = type(value).__name__
    return f"an {name}" if name[:1].lower() in "aeiou" else f"a {name}"


def looks_like_dsn(value: str) -> bool:
    """Whether ``value`` is written as a DSN (URI or ``key=value``), not as a name."""
    return "=" in value or "://" in value


def mask_dsn(dsn: str) -> str:
    """``dsn`` with its password replaced by :data:`MASK`, in either DSN form; an
    unparsable one loses what follows ``password`` or a URI's ``user:`` up to the last
    ``@``: more may be hidden than the password, never less."""
    masked = _URL_PASSWORD.sub(lambda m: f"{m['keep']}{MASK}@", dsn)
    return _KEYED_SECRET.sub(lambda m: f"{m['keep']}{MASK}", masked)


def dsn_secrets(dsn: str) -> list[str]:
    """The passwords written in ``dsn`` (and their pieces around ``@``), longest first:
    what :func:`scrub` removes from a message about that DSN."""
    found: set[str] = set()
    for pattern in (_URL_PASSWORD, _KEYED_SECRET):
        for match in pattern.finditer(dsn):
            secret = match["secret"].strip("'\"")
            found.update((secret, unquote(secret)))  # libpq decodes a URI's percent-encoding
            # libpq ends a URI's password at its first "@": the rest reads as the host
            # and is echoed in "could not translate host name".
            found.update(part for part in re.split(r"[@:]", secret) if len(part) >= 3)
    return sorted((s for s in found if s), key=len, reverse=True)


def scrub(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` with every one of ``secrets`` and anything that looks like a password
    (a URI's, ``password=``) replaced by :data:`MASK`."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, MASK)
    return mask_dsn(text)


class MaskedDSN(str):
    """A DSN whose ``repr`` (tracebacks, ``%r`` logs) masks its password; as a string
    it is the DSN itself."""

    __slots__ = ()

    def __repr__(self) -> str:
        return repr(mask_dsn(str(self)))


class TokenError(ValueError):
    """A token was refused; the message names the rule and the shape, never the token."""


def check_token(value: object) -> str:
    """The bearer token ``value`` stripped (a token file ends with a newline), if it
    is at least :data:`MIN_TOKEN_LENGTH` visible ASCII characters, else
    :class:`TokenError` saying how it is wrong, never what it is."""
    if not isinstance(value, str):
        raise TokenError(
            f"{shape(value)} is not a token: must be a string of at least "
            f"{MIN_TOKEN_LENGTH} characters"
        )
    token = value.strip()
    if len(token) < MIN_TOKEN_LENGTH:
        raise TokenError(
            f"{len(token)} characters (surrounding whitespace dropped) is too short to be "
            f"secret: must be at least {MIN_TOKEN_LENGTH}"
        )
    if not all("!" <= c <= "~" for c in token):
        raise TokenError(
            "it holds spaces, control or non-ASCII characters, which an Authorization "
            "header does not carry intact: use visible ASCII characters only"
        )
    return token
