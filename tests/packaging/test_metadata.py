"""The wheel's metadata is what PyPI shows and accepts: the README as the project page,
the license, and classifiers PyPI knows (an unknown one fails the upload, which
``twine check`` does not catch)."""

from __future__ import annotations

import zipfile
from email.message import Message
from email.parser import Parser
from pathlib import Path

import pytest
from trove_classifiers import classifiers as known_classifiers

from tests.support.distributions import ROOT


@pytest.fixture(scope="module")
def metadata(built_wheel: Path) -> Message:
    """The wheel's ``METADATA``: its headers, and the README as its body."""
    with zipfile.ZipFile(built_wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        return Parser().parsestr(archive.read(name).decode())


def test_every_classifier_is_one_pypi_knows(metadata: Message) -> None:
    shown = metadata.get_all("Classifier", [])
    unknown = sorted(set(shown) - known_classifiers)
    assert not unknown, f"PyPI refuses unknown classifiers: {unknown}"


def test_the_classifiers_name_celery_and_the_supported_django_releases(
    metadata: Message,
) -> None:
    shown = set(metadata.get_all("Classifier", []))
    expected = {
        "Framework :: Celery",
        "Framework :: Django :: 5.2",
        "Framework :: Django :: 6.0",
        "Programming Language :: Python :: 3.11",
        "Typing :: Typed",
    }
    assert expected <= shown, f"missing: {sorted(expected - shown)}"


def test_the_project_page_is_the_readme_in_markdown(metadata: Message) -> None:
    assert metadata["Description-Content-Type"] == "text/markdown"
    body = metadata.get_payload()
    assert isinstance(body, str)
    assert body.strip() == (ROOT / "README.md").read_text().strip()


def test_the_license_is_an_spdx_expression_with_its_file(metadata: Message) -> None:
    assert metadata["License-Expression"] == "MIT"
    assert metadata.get_all("License-File") == ["LICENSE"]
    assert "MIT License" in (ROOT / "LICENSE").read_text()


def test_the_metadata_has_a_summary_keywords_and_an_author(metadata: Message) -> None:
    assert metadata["Summary"]
    assert {"celery", "django", "concurrency"} <= set(metadata["Keywords"].split(","))
    assert metadata["Author"]
