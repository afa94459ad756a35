"""A task's limiters: the names it declares, checked when it is bound, and the
limiters a delivery runs with (a keyed one's: the key's, ``"tenant:acme"``)."""

from __future__ import annotations

import inspect
import os
from collections.abc import Sequence
from typing import Any, cast

from celery import Task

from ..errors import ConcurrencyConfigError
from ..hints import did_you_mean
from ..keys import is_keyed as keyed_limiter
from ..keys import split_key_name
from ..protocol import ConcurrencyLimiter, SupportsKeys, supports
from ..registry import LimiterRegistry

__all__ = [
    "body_signature",
    "by_name",
    "declared_at",
    "is_keyed",
    "key_of",
    "limiter_argument",
    "require",
    "validate_workload",
]


def body_signature(cls: type[Task[Any, Any]]) -> inspect.Signature | None:
    """The parameters a task's body is called with: its run function's, without the
    ``self`` of ``bind=True`` (or of a ``run`` method); ``None`` if unreadable."""
    raw = inspect.getattr_static(cls, "run", None)
    bound = not isinstance(raw, staticmethod)
    function = raw.__func__ if isinstance(raw, staticmethod) else raw
    if not callable(function):
        return None
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return None
    parameters = list(signature.parameters.values())
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if bound and parameters and parameters[0].kind in positional:
        parameters = parameters[1:]
    return signature.replace(parameters=parameters)


def declared_at(cls: type[Task[Any, Any]]) -> str | None:
    """``agents/tasks.py:42``: where the task's body is declared; ``None`` if unknown."""
    raw = inspect.getattr_static(cls, "run", None)
    function = getattr(raw, "__func__", raw)
    code = getattr(inspect.unwrap(function), "__code__", None) if callable(function) else None
    if code is None:
        return None
    try:
        path = os.path.relpath(code.co_filename)
    except ValueError:  # another drive (Windows)
        path = code.co_filename
    return f"{path}:{code.co_firstlineno}"


def require(registry: LimiterRegistry, name: str, where: str) -> None:
    """``registry.require(name)``, its error naming the declaration (``where``) that
    asked for the limiter."""
    try:
        registry.require(name)
    except ConcurrencyConfigError as exc:
        raise ConcurrencyConfigError(f"{where}['limiter']: {exc.message}", limiter=name) from None


def is_keyed(registry: LimiterRegistry, name: str) -> bool:
    """Whether ``name`` is keyed: by its configured limits, else by its having keys."""
    config = registry.config(name)
    return config.keyed if config is not None else keyed_limiter(registry.get(name))


def validate_workload(
    registry: LimiterRegistry, names: Sequence[str], workload: str | None, where: str
) -> None:
    """Raise unless ``workload`` can be used with the limiters ``names``: one must have
    it; over several, at least one, and the others a default workload."""
    if len(names) == 1:
        try:
            registry.validate(names[0], workload)
        except ConcurrencyConfigError as exc:
            if exc.workload is None:  # an unknown limiter: the message names it
                raise ConcurrencyConfigError(f"{where}: {exc.message}", limiter=names[0]) from None
            raise ConcurrencyConfigError(
                f"{where}['workload'] = {workload!r} is invalid: {exc.message} (its "
                f'workloads are {registry.settings_path}["LIMITERS"]["{names[0]}"]'
                '["workloads"])',
                limiter=names[0],
                workload=workload,
            ) from None
        return
    if workload is None:
        return
    configs = [registry.config(name) for name in names]
    known = [config for config in configs if config is not None]
    having = [config for config in known if workload in config.workloads]
    if len(known) == len(configs) and not having:
        every = sorted({w for config in known for w in config.workloads})
        raise ConcurrencyConfigError(
            f"{where}: no limiter of {', '.join(map(repr, names))} has workload "
            f"{workload!r}; {did_you_mean(workload, every)}",
            workload=workload,
        )
    for config in known:
        if workload not in config.workloads:
            try:
                config.resolve_workload(None)
            except ConcurrencyConfigError as exc:
                raise ConcurrencyConfigError(
                    f"{where}: workload {workload!r} is not in limiter {config.name!r}, "
                    f"which would use its default, and it has none: {exc.message}",
                    limiter=config.name,
                    workload=workload,
                ) from None


def key_of(
    limiter: ConcurrencyLimiter, name: str, key: str, *, task_name: str
) -> ConcurrencyLimiter:
    if not supports(limiter, SupportsKeys):
        raise ConcurrencyConfigError(
            f"task {task_name!r}: limiter {name!r} is declared keyed, but the limiter its "
            f"backend built ({type(limiter).__name__}) has no keys (SupportsKeys)",
            limiter=name,
        )
    return cast(SupportsKeys, limiter).key(key)


def by_name(registry: LimiterRegistry, name: str) -> ConcurrencyLimiter:
    """A limiter by the name a run carries: a registry name, or a key's limiter
    (``"tenant:acme"``: the key ``acme`` of the keyed limiter ``tenant``)."""
    base, key = split_key_name(name)
    if key is None:
        return registry.get(name)
    return key_of(registry.get(base), base, key, task_name="-")


def limiter_argument(
    limiters: tuple[ConcurrencyLimiter, ...],
) -> ConcurrencyLimiter | tuple[ConcurrencyLimiter, ...] | None:
    """``run(limiter=...)`` for a task's limiters: none, one, or several as a sequence."""
    if not limiters:
        return None
    return limiters[0] if len(limiters) == 1 else limiters
