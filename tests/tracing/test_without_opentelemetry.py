"""The library imports and holds slots where ``opentelemetry`` is not installed.

A fresh interpreter in which importing any ``opentelemetry`` module fails (as without
the ``otel`` extra) imports ``runcell_celery``, holds slots in and outside a run, and
builds no span.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROGRAM = """
import sys

class NoOpenTelemetry:
    # A finder that refuses every opentelemetry module, wherever it is installed.
    def find_spec(self, name, path=None, target=None):
        if name == "opentelemetry" or name.startswith("opentelemetry."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NoOpenTelemetry())
sys.modules["opentelemetry"] = None

from runcell_celery import create_concurrency_limiter, run, slot
from runcell_celery import tracing

limiter = create_concurrency_limiter(1, name="claude")
with slot(limiter) as held:
    assert held._hold.trace is None
with run(limiter=limiter), slot():
    pass
assert limiter.stats().active == 0
assert not any(name.startswith("opentelemetry") for name in sys.modules if sys.modules[name])
print("otel available:", tracing.OTEL_AVAILABLE, "tracer:", tracing.current_tracer())
"""


def test_the_library_works_without_opentelemetry_installed() -> None:
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "otel available: False tracer: None"
