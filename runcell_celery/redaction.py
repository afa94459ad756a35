"""Say what a secret-bearing value is without saying what it holds.

Some settings may carry a password or a token: ``DATABASE`` (a DSN such as
``postgresql://app:secret@db/app`` or ``host=db password=secret``), the metrics
``TOKEN``, and whatever a user puts in their place by mistake (a Django ``DATABASES``
entry with its ``PASSWORD``, bytes, a list). Errors, log records and pages name such a
setting's field and the value's *shape* (:func:`shape`), a DSN only masked
(:func:`mask_dsn`), and text from elsewhere (psycopg's, libpq's) only scrubbed
(:func:`scrub`): never the secret.

This module imports nothing outside the standard library: the core, the PostgreSQL
backend, the Celery integration, the Django app, the exporter and the pytest plugin
all use it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

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
    """Describe ``value`` by its type and size, never by its content.

    ``"a str of 31 characters"``, ``"bytes (24 bytes)"``, ``"a dict with keys 'NAME',
    'PASSWORD'"``, ``"a list of 2 items"``, ``"None"``, ``"a ConnectionPool"``. A
    mapping's keys are names, not secrets, and say what was meant.
    """
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
    """``dsn`` with its password replaced by :data:`MASK`, in either DSN form.

    ``postgresql://app:secret@db/app`` gives ``postgresql://app:***@db/app``;
    ``host=db password='a b'`` gives ``host=db password=***``. A DSN that cannot be
    parsed is masked the same way (what follows ``password`` or the ``:`` of a URI's
    user, up to the last ``@``), so more may be hidden than the password, never less.
    """
    masked = _URL_PASSWORD.sub(lambda m: f"{m['keep']}{MASK}@", dsn)
    return _KEYED_SECRET.sub(lambda m: f"{m['keep']}{MASK}", masked)


def dsn_secrets(dsn: str) -> list[str]:
    """The passwords written in ``dsn`` (and their pieces around ``@``), longest first:
    what :func:`scrub` removes from a message about that DSN."""
    found: set[str] = set()
    for pattern in (_URL_PASSWORD, _KEYED_SECRET):
        for match in pattern.finditer(dsn):
            secret = match["secret"].strip("'\"")
            found.add(secret)
            if "%" in secret:  # a URI's percent-encoding, as libpq decodes it
                from urllib.parse import unquote

                found.add(unquote(secret))
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
    """A DSN whose ``repr`` masks its password: what a pytest traceback, a dict's repr
    or a log of ``%r`` shows. ``str()`` and every use as a string are the DSN itself."""

    __slots__ = ()

    def __repr__(self) -> str:
        return repr(mask_dsn(str(self)))


class TokenError(ValueError):
    """A token was refused; the message names the rule and the shape, never the token."""


def check_token(value: object) -> str:
    """The bearer token ``value`` ready to compare, or :class:`TokenError`.

    Surrounding whitespace is dropped (a token read from a file ends with a newline,
    which no ``Authorization`` header can carry); what remains must be a string of at
    least :data:`MIN_TOKEN_LENGTH` visible ASCII characters. The error says how the
    value is wrong (its type, its length, which rule), never what it is.
    """
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
