"""A stdlib client for the fake provider, safe in threads and in forked or spawned processes.

A client holds only a URL and a timeout: every call opens its own connection (no pool,
no socket made at import or construction), so one client can be shared by threads,
inherited by a forked Celery worker or pickled into a spawned process. Proxies named
in the environment are ignored: the provider is local, and an ``HTTP_PROXY`` meant
for the outside world must not swallow loopback calls.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from collections.abc import Generator
from typing import cast

from .wire import (
    FENCING_TOKEN_HEADER,
    LIMITER_HEADER,
    FakeProviderError,
    FakeProviderStats,
    JSONObject,
)

__all__ = ["FakeProviderClient"]


class FakeProviderClient:
    """Call a fake provider at ``url`` (e.g. ``FakeProvider.url``).

    HTTP errors raise :class:`~.wire.FakeProviderError` with the status and the decoded
    error body; a provider that cannot be reached raises ``urllib.error.URLError``
    (an ``OSError``), and a call slower than ``timeout`` seconds raises ``TimeoutError``
    or ``URLError``, which closes the connection so the provider stops counting it.
    """

    def __init__(self, url: str, timeout: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout

    def create(
        self,
        prompt: str,
        *,
        latency_ms: float | None = None,
        fencing_token: int | None = None,
        limiter: str | None = None,
    ) -> JSONObject:
        """Send one message request and return the provider's JSON reply.

        ``latency_ms`` overrides the server's default; ``fencing_token`` (with
        ``limiter``) is sent as the lease's fencing headers.
        """
        body = _body(prompt, latency_ms=latency_ms, stream=False)
        headers = _headers(limiter, fencing_token)
        with self._open("POST", "/v1/messages", body, headers) as response:
            return _decode_object(response.read())

    def stream(
        self,
        prompt: str,
        *,
        latency_ms: float | None = None,
        chunks: int | None = None,
        fencing_token: int | None = None,
        limiter: str | None = None,
    ) -> Generator[str, None, None]:
        """Stream a reply and yield its text pieces as they arrive.

        This is a generator: the request is sent on the first ``next()``, and the
        provider counts it in flight until ``[DONE]``. Closing the generator early
        hangs up, which the provider counts as ``disconnected``. A stream that ends
        without ``[DONE]`` raises :class:`~.wire.FakeProviderError`.
        """
        body = _body(prompt, latency_ms=latency_ms, stream=True, chunks=chunks)
        headers = _headers(limiter, fencing_token)
        with self._open("POST", "/v1/messages", body, headers) as response:
            for raw in response:
                line = raw.decode().rstrip("\r\n")
                if not line.startswith("data:"):
                    continue  # blank separators, comments, "event:" lines
                data = line.removeprefix("data:").strip()
                if data == "[DONE]":
                    return
                event = _decode_object(data.encode())
                if event.get("type") == "error":
                    raise FakeProviderError(response.status, event)
                yield str(event["delta"]["text"])
            message = "the stream ended before [DONE]"
            error = {"type": "error", "error": {"type": "incomplete_stream", "message": message}}
            raise FakeProviderError(response.status, error)

    def health(self) -> JSONObject:
        """Return ``GET /health`` (``{"status": "ok"}``)."""
        with self._open("GET", "/health") as response:
            return _decode_object(response.read())

    def stats(self) -> FakeProviderStats:
        """Return the provider's counters (``GET /stats``)."""
        with self._open("GET", "/stats") as response:
            return FakeProviderStats.from_json(_decode_object(response.read()))

    def reset(self) -> FakeProviderStats:
        """Zero the provider's counters (``POST /reset``) and return them."""
        with self._open("POST", "/reset", b"") as response:
            return FakeProviderStats.from_json(_decode_object(response.read()))

    def wait_idle(self, timeout: float = 10.0, *, poll_seconds: float = 0.02) -> FakeProviderStats:
        """Poll until nothing is in flight; return the counters (``TimeoutError`` if not).

        The provider records an outcome a moment after the client has read the answer,
        so read ``completed`` and friends after this, not right after the call.
        """
        deadline = time.monotonic() + timeout
        while (stats := self.stats()).in_flight:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{stats.in_flight} requests still in flight after {timeout}s")
            time.sleep(poll_seconds)
        return stats

    def _open(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> http.client.HTTPResponse:
        request = urllib.request.Request(
            self.url + path, data=body, headers=headers or {}, method=method
        )
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # no env proxies
        try:
            return cast(http.client.HTTPResponse, opener.open(request, timeout=self.timeout))
        except urllib.error.HTTPError as exc:
            with exc:
                raw = exc.read()
            try:
                detail: JSONObject | str = _decode_object(raw)
            except ValueError:
                detail = raw.decode(errors="replace")
            raise FakeProviderError(exc.code, detail) from None

    def __repr__(self) -> str:
        return f"FakeProviderClient({self.url!r}, timeout={self.timeout!r})"


def _body(
    prompt: str, *, latency_ms: float | None, stream: bool, chunks: int | None = None
) -> bytes:
    request: JSONObject = {"prompt": prompt, "stream": stream}
    if latency_ms is not None:
        request["latency_ms"] = latency_ms
    if chunks is not None:
        request["chunks"] = chunks
    return json.dumps(request).encode()


def _headers(limiter: str | None, fencing_token: int | None) -> dict[str, str]:
    headers = {"Content-Type": "application/json"}
    if fencing_token is not None:
        if not limiter:
            raise ValueError(f"fencing_token={fencing_token!r} needs the limiter it belongs to")
        headers[LIMITER_HEADER] = limiter
        headers[FENCING_TOKEN_HEADER] = str(fencing_token)
    elif limiter:
        headers[LIMITER_HEADER] = limiter
    return headers


def _decode_object(raw: bytes) -> JSONObject:
    data = json.loads(raw)
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object from the fake provider, got {data!r}")
    return data
