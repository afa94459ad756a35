"""Fixtures of the metrics tests: Django configured in-process (for the view), the
session's PostgreSQL database, the Celery scaffolding, and scrapes parsed with
prometheus_client's own text parser."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from prometheus_client.parser import text_string_to_metric_families

from runcell_celery.metrics import uninstall_event_metrics
from tests.support.django_setup import configure_django
from tests.support.pg import make_limiter, pg_dsn

__all__ = ["make_limiter", "pg_dsn"]

#: The bearer token of the tests' view and exporter (16 characters at least).
TOKEN = "metrics-test-token-0123456789"


def pytest_configure(config: pytest.Config) -> None:
    configure_django(config)


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


class Scrape:
    """One scrape's samples, parsed by ``text_string_to_metric_families``."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.families = {f.name: f for f in text_string_to_metric_families(text)}
        self.samples = [
            Sample(s.name, dict(s.labels), s.value)
            for family in self.families.values()
            for s in family.samples
        ]

    def values(self, name: str, **labels: str) -> list[float]:
        return [
            s.value
            for s in self.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        ]

    def total(self, name: str, **labels: str) -> float:
        """The sum of ``name``'s samples matching ``labels`` (0 when there is none)."""
        return sum(self.values(name, **labels))


@pytest.fixture
def event_metrics_cleanup() -> Iterator[None]:
    """Tests that install the event metrics in this process uninstall them after."""
    yield
    uninstall_event_metrics()
