"""What the fake provider's server and client agree on: headers, counters, errors.

Apart from both, so the client (imported by Celery workers and spawned processes) never
pulls in the server.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "FENCING_TOKEN_HEADER",
    "LIMITER_HEADER",
    "FakeProviderError",
    "FakeProviderStats",
    "JSONObject",
]

#: A decoded JSON object, as the server sends and the client returns it.
JSONObject = dict[str, Any]

#: The limiter whose lease a request is made under (with :data:`FENCING_TOKEN_HEADER`).
LIMITER_HEADER = "X-Runcell-Limiter"
#: The lease's fencing token: an integer that grows with every lease of that limiter.
FENCING_TOKEN_HEADER = "X-Runcell-Fencing-Token"


@dataclass(frozen=True)
class FakeProviderStats:
    """The server's own counters: the witness that a concurrency limit held.

    Every ``POST /v1/messages`` counts in ``total`` on arrival and in ``in_flight``
    until it ends in exactly one of ``completed``, ``errors`` (injected 529s, invalid
    requests, server stopping), ``rejected_stale`` (strict fencing) or ``disconnected``
    (the client went away first), so ``total == in_flight + completed + errors +
    rejected_stale + disconnected``. ``fencing_tokens``: the highest token per limiter.
    """

    in_flight: int = 0
    max_in_flight: int = 0
    total: int = 0
    completed: int = 0
    errors: int = 0
    rejected_stale: int = 0
    disconnected: int = 0
    fencing_tokens: Mapping[str, int] = field(default_factory=dict)

    def to_json(self) -> JSONObject:
        """The counters as ``GET /stats`` answers them."""
        return {**dataclasses.asdict(self), "fencing_tokens": dict(self.fencing_tokens)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> FakeProviderStats:
        """The counters of a ``GET /stats`` answer."""
        tokens = {str(k): int(v) for k, v in data["fencing_tokens"].items()}
        counts = {f.name: int(data[f.name]) for f in dataclasses.fields(cls)[:-1]}
        return cls(**counts, fencing_tokens=tokens)


class FakeProviderError(Exception):
    """The fake provider answered with an HTTP error (or cut a stream short).

    ``status`` is the HTTP status (529 overloaded, 409 stale fencing token, 400 invalid
    request, 503 stopping; a stream's 200 when it ended before ``[DONE]``); ``body`` the
    decoded JSON error, or the raw text. Both stay in ``args`` so the error pickles, as
    Celery needs.
    """

    def __init__(self, status: int, body: JSONObject | str) -> None:
        super().__init__(status, body)
        self.status = status
        self.body = body

    @property
    def error_type(self) -> str | None:
        """The error's ``type`` (``overloaded_error``, ``stale_fencing_token``, ...)."""
        error = self.body.get("error") if isinstance(self.body, dict) else None
        kind = error.get("type") if isinstance(error, dict) else None
        return kind if isinstance(kind, str) else None

    def __str__(self) -> str:
        error = self.body.get("error") if isinstance(self.body, dict) else None
        message = error.get("message") if isinstance(error, dict) else self.body
        kind = f" ({self.error_type})" if self.error_type else ""
        return f"fake provider answered HTTP {self.status}{kind}: {message}"
