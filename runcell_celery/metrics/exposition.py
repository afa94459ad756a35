"""What a scrape serves, for the Django view and the exporter alike.

With a multiprocess directory (``PROMETHEUS_MULTIPROC_DIR``) the event metrics are the
sums of every process on this host, exited prefork children included; without it, this
process's own (right for a solo or threads worker, blind to other processes).
"""

from __future__ import annotations

import glob
import hmac
import os
from collections.abc import Iterable
from pathlib import Path

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

__all__ = ["MULTIPROC_ENV", "bearer_token_matches", "build_registry", "multiprocess_dir", "render"]

#: prometheus_client's own variable: where every process writes its values.
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def multiprocess_dir(given: str | os.PathLike[str] | None = None) -> Path | None:
    """The multiprocess directory to read: ``given``, else ``PROMETHEUS_MULTIPROC_DIR``.

    :raises ValueError: the directory does not exist (prometheus_client would serve
        nothing, silently).
    """
    source = "the multiprocess directory"
    if given is None:
        given, source = os.environ.get(MULTIPROC_ENV) or None, MULTIPROC_ENV
    if given is None:
        return None
    if not Path(given).is_dir():
        raise ValueError(
            f"{source} = {str(given)!r} is invalid: no such directory (create it before the "
            "workers start, and give every worker and the exporter the same one)"
        )
    return Path(given)


def build_registry(
    *,
    gauges: Collector | None = None,
    multiproc: Path | None = None,
    process_registry: CollectorRegistry = REGISTRY,
) -> CollectorRegistry:
    """A registry for scrapes: event metrics (from ``multiproc``, else from
    ``process_registry``) and ``gauges`` when given."""
    registry = CollectorRegistry(auto_describe=False)
    if multiproc is not None:
        registry.register(_ProcessFileSums(multiproc))
    else:
        registry.register(process_registry)  # collected at scrape time, as it is then
    if gauges is not None:
        registry.register(gauges)
    return registry


class _ProcessFileSums(Collector):
    """The sums of every process's file in a multiprocess directory, like
    prometheus_client's ``MultiProcessCollector``, but skipping a file that is still
    empty: a process creates its file before it sizes it, and one killed in between
    leaves it empty for good, which would fail every scrape of the host
    (prometheus/client_python#1199). (A live gauge's file deleted since the glob, by
    ``mark_process_dead``, prometheus_client's merge skips itself.)"""

    def __init__(self, directory: Path) -> None:
        self._directory = directory

    def collect(self) -> Iterable[Metric]:
        files = []
        for path in glob.glob(os.path.join(self._directory, "*.db")):
            try:
                if os.path.getsize(path) > 0:
                    files.append(path)
            except FileNotFoundError:
                continue
        return list(MultiProcessCollector.merge(files, accumulate=True))  # type: ignore[no-untyped-call]


def render(registry: CollectorRegistry, accept: str | None) -> tuple[bytes, str]:
    """The registry's metrics in the format ``accept`` asks for, and its content type."""
    encoder, content_type = choose_encoder(accept or "")
    return encoder(registry), content_type


def bearer_token_matches(authorization: str | None, token: str) -> bool:
    """Whether ``Authorization: Bearer <token>`` carries ``token`` (constant time)."""
    scheme, _, given = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(
        given.strip().encode(), token.encode()
    )
