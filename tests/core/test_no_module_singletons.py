"""No module-level mutable singleton in ``runcell_celery`` or ``runcell_django``.

Per-process state has one owner, :data:`runcell_celery.background.DEFAULT_REGISTRY`.
The scan imports every module (Django configured in a child interpreter, so this test
run's own Django is untouched), then checks each name a module assigns at its top
level and every ``global`` statement (state rebound at module level).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from runcell_celery.background import DEFAULT_REGISTRY, ProcessRegistry

ROOT = Path(__file__).resolve().parents[2]

SCAN = r"""
import ast, dataclasses, enum, importlib, json, logging, re, sys, types, typing
import contextvars
from pathlib import Path

import django
from django.conf import settings

settings.configure(
    INSTALLED_APPS=[
        "django.contrib.admin", "django.contrib.auth", "django.contrib.contenttypes",
        "django.contrib.sessions", "django.contrib.messages", "runcell_django",
    ],
    DATABASES={}, USE_TZ=True,
)
django.setup()

import runcell_celery, runcell_django
from celery.utils.dispatch import Signal
from django.utils.functional import Promise
from runcell_celery.background import DEFAULT_REGISTRY

SCALARS = (type(None), bool, int, float, complex, str, bytes, range, re.Pattern, Promise)
# Declared once per module by design: a context variable is per context, a logger is
# logging's, a Celery signal is the public hook (like Celery's own signals).
DECLARATIONS = (logging.Logger, contextvars.ContextVar, Signal, typing.TypeVar,
                typing.ParamSpec, enum.Enum, types.GenericAlias, types.UnionType,
                types.FunctionType, types.BuiltinFunctionType, types.ModuleType, type)

def immutable(value):
    if isinstance(value, SCALARS + DECLARATIONS) or type(value) is object:
        return True
    if type(value).__module__ == "typing":  # Literal[...], Callable[...] aliases
        return True
    if isinstance(value, (tuple, frozenset)):
        return all(immutable(item) for item in value)
    if isinstance(value, types.MappingProxyType):
        return all(immutable(k) and immutable(v) for k, v in value.items())
    if dataclasses.is_dataclass(value) and value.__dataclass_params__.frozen:
        return all(immutable(getattr(value, f.name)) for f in dataclasses.fields(value))
    return False

found = []
for package in (runcell_celery, runcell_django):
    root = Path(package.__file__).parent
    for path in sorted(root.rglob("*.py")):
        if "migrations" in path.parts:
            continue
        parts = [package.__name__, *path.relative_to(root).with_suffix("").parts]
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        module = importlib.import_module(name)
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Global):
                found.append(f"{name}: global {', '.join(node.names)} (line {node.lineno})")
        assigned = set()
        for node in tree.body:
            targets = {ast.Assign: lambda n: n.targets,
                       ast.AnnAssign: lambda n: [n.target],
                       ast.AugAssign: lambda n: [n.target]}.get(type(node), lambda n: [])(node)
            for target in targets:
                assigned |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        for attribute in sorted(assigned - {"__all__"}):
            value = getattr(module, attribute)
            if value is DEFAULT_REGISTRY or immutable(value):
                continue
            found.append(f"{name}.{attribute}: {type(value).__module__}.{type(value).__qualname__}")
print(json.dumps(found))
"""


def scan() -> list[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "django_app")])}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    done = subprocess.run(
        [sys.executable, "-c", SCAN], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return list(json.loads(done.stdout.splitlines()[-1]))


def test_no_module_holds_mutable_state_but_the_default_registry() -> None:
    assert scan() == []


def test_shared_entries_are_made_once_and_kept() -> None:
    registry = ProcessRegistry()
    made = registry.shared("a", dict)
    made["x"] = 1
    assert registry.shared("a", dict) is made
    empty = registry.shared("empty", list)  # a falsy object is made only once too
    assert registry.shared("empty", list) is empty
    assert registry.value("flag", False) is False
    registry.put("flag", True)
    assert registry.value("flag", False) is True
    assert registry.lock("l") is registry.lock("l")
    assert registry.local("p", object) is registry.local("p", object)


def test_entries_are_made_once_under_contention() -> None:
    registry = ProcessRegistry()
    barrier = threading.Barrier(8)
    seen: list[object] = []

    def take() -> None:
        barrier.wait()
        seen.append(registry.shared("s", object))

    threads = [threading.Thread(target=take) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len({id(item) for item in seen}) == 1


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_keeps_shared_state_and_gets_fresh_local_state_and_locks() -> None:
    shared = DEFAULT_REGISTRY.shared("tests.shared", dict)
    local = DEFAULT_REGISTRY.local("tests.local", dict)
    lock = DEFAULT_REGISTRY.lock("tests.lock")
    lock.acquire()  # held by the parent at fork time: the child must not deadlock
    try:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            ok = (
                DEFAULT_REGISTRY.shared("tests.shared", dict) is shared
                and DEFAULT_REGISTRY.local("tests.local", dict) is not local
                and DEFAULT_REGISTRY.lock("tests.lock").acquire(timeout=5)
            )
            os.write(write, b"1" if ok else b"0")
            os._exit(0)
        os.close(write)
        answer = os.read(read, 1)
        os.waitpid(pid, 0)
        os.close(read)
    finally:
        lock.release()
    assert answer == b"1"
    assert DEFAULT_REGISTRY.local("tests.local", dict) is local
