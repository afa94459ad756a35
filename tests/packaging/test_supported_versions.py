"""The built wheel admits the current releases, and its lower bounds are what nox tests.

Read from the wheel's own metadata (``Requires-Dist``, ``Requires-Python``), the way
pip decides whether a project on Django 6 or Celery 5.7 may install the package: an
upper bound in any extra would lock those projects out.
"""

from __future__ import annotations

import re
import zipfile
from email.message import Message
from email.parser import HeaderParser
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import Version

import noxfile

#: Releases a user may run today: each must be admitted by every requirement naming it.
CURRENT_RELEASES = [
    ("django", "5.2.0"),
    ("django", "6.0.0"),
    ("django", "6.1"),
    ("django", "6.1.5"),
    ("celery", "5.7.0"),
    ("psycopg", "3.3.0"),
    ("psycopg", "3.3.9"),
    ("psycopg-pool", "3.3.0"),
]


@pytest.fixture(scope="module")
def metadata(built_wheel: Path) -> Message:
    """The wheel's ``METADATA`` file, parsed as the email headers it is."""
    with zipfile.ZipFile(built_wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        return HeaderParser().parsestr(archive.read(name).decode())


def requirements_named(metadata: Message, name: str) -> list[Requirement]:
    """Every ``Requires-Dist`` for ``name``, whichever extra it belongs to."""
    requirements = [Requirement(line) for line in metadata.get_all("Requires-Dist", [])]
    found = [r for r in requirements if canonicalize_name(r.name) == canonicalize_name(name)]
    assert found, f"the wheel does not require {name} in any extra"
    return found


@pytest.mark.parametrize(("name", "version"), CURRENT_RELEASES)
def test_every_requirement_on_a_dependency_admits_its_current_release(
    metadata: Message, name: str, version: str
) -> None:
    refused = [str(r) for r in requirements_named(metadata, name) if version not in r.specifier]
    assert not refused, f"{name} {version} is refused by {refused}"


def test_the_wheel_admits_python_3_11_and_newer(metadata: Message) -> None:
    requires_python = SpecifierSet(metadata["Requires-Python"])
    for version in ("3.11", "3.12", "3.13", "3.14"):
        assert version in requires_python, f"Requires-Python {requires_python} refuses {version}"


def _pinned(pins: tuple[str, ...]) -> dict[str, SpecifierSet]:
    """``{name: specifier}`` of a nox session's pins (``"celery[redis]==5.4.0"``)."""
    return {canonicalize_name(Requirement(pin).name): Requirement(pin).specifier for pin in pins}


def _lower_bound(specifier: SpecifierSet) -> Version:
    (bound,) = [Version(s.version) for s in specifier if s.operator == ">="]
    return bound


@pytest.mark.parametrize("name", sorted(_pinned(noxfile.OLDEST)))
def test_the_lower_bound_of_each_dependency_is_the_version_the_oldest_session_tests(
    metadata: Message, name: str
) -> None:
    (pin,) = _pinned(noxfile.OLDEST)[name]
    assert pin.operator == "==", f"the oldest session must pin {name} exactly, not {pin}"
    bounds = {_lower_bound(r.specifier) for r in requirements_named(metadata, name)}
    assert bounds == {Version(pin.version)}, (
        f"pyproject admits {name} from {sorted(map(str, bounds))}; "
        f"noxfile.py's oldest session tests {pin.version}"
    )


@pytest.mark.parametrize("name", sorted(_pinned(noxfile.NEWEST)))
def test_the_newest_session_tests_releases_the_wheel_admits(metadata: Message, name: str) -> None:
    (pin,) = _pinned(noxfile.NEWEST)[name]
    newest_minor = re.sub(r"\.\*$", ".0", pin.version)
    for requirement in requirements_named(metadata, name):
        assert newest_minor in requirement.specifier, f"{requirement} refuses {pin}"
