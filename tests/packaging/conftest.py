"""The sdist and the wheel, built once for every packaging test
(:mod:`tests.support.distributions`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.distributions import Distributions, build_distributions


@pytest.fixture(scope="session")
def built_distributions(tmp_path_factory: pytest.TempPathFactory) -> Distributions:
    """``python -m build`` on a copy of the checkout: the sdist, and the wheel from it."""
    return build_distributions(tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("dist"))


@pytest.fixture(scope="session")
def built_wheel(built_distributions: Distributions) -> Path:
    """The wheel ``python -m build`` made from the sdist."""
    return built_distributions.wheel
