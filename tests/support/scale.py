"""How big the stress tests run: ``RUNCELL_STRESS_SCALE`` (``ci``=1, ``full``=5, or a number)."""

from __future__ import annotations

import os

import pytest

_NAMED = {"ci": 1.0, "full": 5.0}


def stress_scale_value() -> float:
    raw = os.environ.get("RUNCELL_STRESS_SCALE", "ci")
    try:
        return _NAMED[raw] if raw in _NAMED else float(raw)
    except ValueError as exc:
        raise ValueError(
            f"RUNCELL_STRESS_SCALE={raw!r} is invalid: use 'ci', 'full' or a number"
        ) from exc


@pytest.fixture
def stress_scale() -> float:
    """Multiplier for stress sizes; 1.0 is the size the issues require."""
    return stress_scale_value()
