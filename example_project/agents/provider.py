"""The provider client the tasks use: one slot per request, retried inside it like an SDK.

Real code would wrap ``anthropic.Anthropic().messages.create`` the same way: the SDK
retries an overloaded (529) answer itself, inside the one call, so the slot covers
the call and its retries. Here the fake provider stands in
(``RUNCELL_DEMO_PROVIDER_URL``), and it counts the requests it has in flight, which
is how the demo proves the limit held.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import cache
from typing import TypeVar

from django.conf import settings

from runcell_celery import slot
from runcell_celery.testing import FakeProviderClient, FakeProviderError

#: Attempts per request, as provider SDKs retry overloaded (529) answers themselves.
#: With the demo's 5 % of 529 answers, three attempts left about one run in forty
#: with a task failing on three overloads in a row; five make that about 3 in 10^7
#: per request.
ATTEMPTS = 5
RETRY_DELAY_S = 0.05

T = TypeVar("T")


def _client() -> FakeProviderClient:
    """The client of ``settings.PROVIDER_URL`` (read at each call: tests point it at a
    fake provider of their own)."""
    return _client_of(settings.PROVIDER_URL)


@cache
def _client_of(url: str) -> FakeProviderClient:
    return FakeProviderClient(url, timeout=60)


def _call(request: Callable[[int | None], T]) -> T:
    """One provider request in one slot; an overloaded answer is retried inside it."""
    with slot() as held:
        for attempt in range(1, ATTEMPTS + 1):
            try:
                return request(held.fencing_token)
            except FakeProviderError as exc:
                if exc.status != 529 or attempt == ATTEMPTS:
                    raise
            time.sleep(RETRY_DELAY_S * attempt)
    raise AssertionError("unreachable")


def create(prompt: str) -> str:
    """Send one message request and return the reply's text."""

    def request(token: int | None) -> str:
        reply = _client().create(prompt, fencing_token=token, limiter="provider")
        return str(reply["content"][0]["text"])

    return _call(request)


def stream(prompt: str) -> str:
    """Stream a reply; the slot is held until the stream ends."""

    def request(token: int | None) -> str:
        return "".join(_client().stream(prompt, fencing_token=token, limiter="provider"))

    return _call(request)
