"""Sphinx configuration of the runcell_celery documentation.

Built in CI with warnings as errors (``scripts/test``)::

    sphinx-build -W --keep-going -b html docs docs/_build/html

The pages are Markdown (MyST-Parser); the API reference is generated from the
docstrings (autodoc). No extension reaches the network: intersphinx is not used.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The library at the top, the Django app under its source root django_app/, as in a
# checkout (pytest and mypy put both on the path the same way).
sys.path[:0] = [str(ROOT), str(ROOT / "django_app")]

import django  # noqa: E402
from celery.app.task import Task as CeleryTask  # noqa: E402
from django.conf import settings  # noqa: E402
from sphinx.application import Sphinx  # noqa: E402
from sphinx.pycode import ModuleAnalyzer  # noqa: E402

from runcell_celery import __version__  # noqa: E402

# runcell_django's modules import Django's models and admin: a minimal configuration is
# enough to import them (no database is opened while the docs build).
if not settings.configured:
    settings.configure(
        INSTALLED_APPS=[
            "django.contrib.admin",
            "django.contrib.auth",
            "django.contrib.contenttypes",
            "django.contrib.sessions",
            "django.contrib.messages",
            "runcell_django",
        ],
        DATABASES={},
        RUNCELL={"BACKEND": "memory", "LIMITERS": {}, "EVENTS": {"ENABLED": False}},
        USE_TZ=True,
    )
    django.setup()

project = "runcell_celery"
author = "runcell_celery maintainers"
copyright = "runcell_celery maintainers"
release = __version__
version = __version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]
# Every page is in the toctree; a page left out is a warning (an error in CI).
suppress_warnings: list[str] = []

# MyST: anchors for headings down to ###, so pages link to sections as page.md#anchor
# (the README does the same, docs/page.md#anchor), checked like every other link.
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence", "deflist"]

# autodoc: the members each module exports (its __all__), in the order written there.
autodoc_default_options = {
    "members": True,
    "undoc-members": True,
    "member-order": "bysource",
}
autodoc_typehints = "description"
autodoc_class_signature = "separated"
autodoc_inherit_docstrings = True
napoleon_google_docstring = False
napoleon_numpy_docstring = True

html_theme = "alabaster"
html_title = f"runcell_celery {release}"
html_static_path: list[str] = []
html_theme_options = {
    "description": "Concurrency limits for LLM-provider calls in Celery fleets",
    "fixed_sidebar": True,
    "page_width": "1160px",
}


# Celery sets these options on every task class when it binds it to an app (Task.bind,
# from app.conf): on RunCellTask they are Celery's, documented with Celery's own roles,
# and not part of this API.
CELERY_BOUND_ATTRIBUTES = {"request_stack", "typing"} | {name for name, _ in CeleryTask.from_config}


def skip_celery_bound_attributes(
    app: Sphinx, what: str, name: str, obj: object, skip: bool, options: object
) -> bool | None:
    """Leave out the Celery options Celery's binding copies onto a task class."""
    if what == "class" and name in CELERY_BOUND_ATTRIBUTES:
        return True
    return None


def doc_comment(module_name: str, name: str) -> list[str]:
    """The ``#:`` comment of ``name`` in the module ``module_name`` imports it from.

    A constant re-exported by a package's ``__init__`` (``from .schema import
    SCHEMA_VERSION``) has its comment where it is defined; autodoc looks for it only in
    the module it documents, and shows the value's type's docstring instead.
    """
    module = importlib.import_module(module_name)
    package = module.__package__ or module_name
    for node in ast.parse(inspect.getsource(module)).body:
        if not isinstance(node, ast.ImportFrom):
            continue
        if not any(alias.name == name and alias.asname in (None, name) for alias in node.names):
            continue
        source = importlib.util.resolve_name("." * node.level + (node.module or ""), package)
        comment = ModuleAnalyzer.for_module(source).find_attr_docs().get(("", name))
        return list(comment or [])
    return []


def document_reexported_data(
    app: Sphinx, what: str, name: str, obj: object, options: object, lines: list[str]
) -> None:
    """Give a re-exported constant the comment written where it is defined."""
    if what != "data":
        return
    module_name, _, attr = name.rpartition(".")
    comment = doc_comment(module_name, attr)
    if not comment:
        return
    type_doc = inspect.getdoc(type(obj)) or ""
    if lines and type_doc and lines[0] == type_doc.splitlines()[0]:
        lines[:] = comment  # the value's type's docstring (int's, str's): not this name's
    else:
        lines[:0] = [*comment, ""]  # before "alias of ..."


def setup(app: Sphinx) -> None:
    app.connect("autodoc-skip-member", skip_celery_bound_attributes)
    app.connect("autodoc-process-docstring", document_reexported_data)
