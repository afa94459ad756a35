"""A stdlib client for the fake provider, safe in threads and in forked or spawned processes.

A client holds only a URL and a timeout; every call opens its own connection, so one
client can be shared by threads, inherited by a forked worker or pickled into a spawned
process. Proxies named in the environment are ignored: the provider is local, and an
``HTTP_PROXY`` meant for the outside world must not swallow loopback calls.
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
    """Call a fake provider at ``url``. HTTP errors raise :class:`~.wire.FakeProviderError`;
    an unreachable provider ``URLError``; a call slower than ``timeout`` seconds
    ``TimeoutError`` or ``URLError``, closing the connection so the provider stops counting it.
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
        """Send one message request and return the provider's JSON reply (``latency_ms``
        overrides the server's; ``fencing_token`` and ``limiter`` are the fencing headers)."""
        with self._message(prompt, fencing_token, limiter, latency_ms=latency_ms) as response:
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
        """Yield a reply's text pieces as they arrive: sent on the first ``next()``, in
        flight until ``[DONE]`` (closing early hangs up: ``disconnected``; a stream cut
        before ``[DONE]`` raises :class:`~.wire.FakeProviderError`)."""
        fields = {"stream": True, "latency_ms": latency_ms, "chunks": chunks}
        with self._message(prompt, fencing_token, limiter, **fields) as response:
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
        return self._json("GET", "/health")

    def stats(self) -> FakeProviderStats:
        """Return the provider's counters (``GET /stats``)."""
        return FakeProviderStats.from_json(self._json("GET", "/stats"))

    def reset(self) -> FakeProviderStats:
        """Zero the provider's counters (``POST /reset``) and return them."""
        return FakeProviderStats.from_json(self._json("POST", "/reset", b""))

    def wait_idle(self, timeout: float = 10.0, *, poll_seconds: float = 0.02) -> FakeProviderStats:
        """Poll until nothing is in flight; return the counters (``TimeoutError`` if not).
        The provider records an outcome just after the client read the answer."""
        deadline = time.monotonic() + timeout
        while (stats := self.stats()).in_flight:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{stats.in_flight} requests still in flight after {timeout}s")
            time.sleep(poll_seconds)
        return stats

    def _message(
        self, prompt: str, fencing_token: int | None, limiter: str | None, **fields: object
    ) -> http.client.HTTPResponse:
        if fencing_token is not None and not limiter:
            raise ValueError(f"fencing_token={fencing_token!r} needs the limiter it belongs to")
        request = {"prompt": prompt, "stream": False}
        request.update((name, value) for name, value in fields.items() if value is not None)
        headers = {"Content-Type": "application/json"}
        if limiter:
            headers[LIMITER_HEADER] = limiter
        if fencing_token is not None:
            headers[FENCING_TOKEN_HEADER] = str(fencing_token)
        return self._open("POST", "/v1/messages", json.dumps(request).encode(), headers)

    def _json(self, method: str, path: str, body: bytes | None = None) -> JSONObject:
        with self._open(method, path, body) as response:
            return _decode_object(response.read())

    def _open(
        self, method: str, path: str, body: bytes | None, headers: dict[str, str] | None = None
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


def _decode_object(raw: bytes) -> JSONObject:
    data = json.loads(raw)
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object from the fake provider, got {data!r}")
    return data
