"""The members of one request: what may be held together, and with which workload.

``slot(openai, gpt_4o, tenants.key("acme"))`` and ``run(limiter=[openai, tenant_key])``
name several limiters; these checks run before anything waits, for both.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from .config import DEFAULT_WORKLOAD
from .errors import ConcurrencyConfigError
from .keys import is_keyed, split_key_name
from .protocol import (
    ConcurrencyLimiter,
    SupportsConfig,
    SupportsMembers,
    SupportsValidateWorkload,
    supports,
)

__all__ = [
    "check_members",
    "default_key",
    "has_workload",
    "resolve_workloads",
    "validate_workload",
]


def _names(limiters: Sequence[ConcurrencyLimiter]) -> str:
    return ", ".join(repr(limiter.name) for limiter in limiters)


def check_members(limiters: Sequence[ConcurrencyLimiter]) -> None:
    """Raise ``ConcurrencyConfigError`` unless ``limiters`` can be held together."""
    seen: set[str] = set()
    for limiter in limiters:
        name = limiter.name
        if is_keyed(limiter):
            raise ConcurrencyConfigError(
                f"limiter {name!r} is keyed: it has a limit per key and no slots of its own; "
                f"name one of its keys, {name}.key(...), e.g. slot(..., {name}.key(tenant_id))",
                limiter=name,
            )
        if name in seen:
            raise ConcurrencyConfigError(
                f"limiters {_names(limiters)}: {name!r} is named twice; a request "
                "takes one slot in each limiter, so name each once",
                limiter=name,
            )
        seen.add(name)
    first = limiters[0]
    if len({type(limiter) for limiter in limiters}) > 1:
        backends = ", ".join(f"{x.name!r} ({type(x).__name__})" for x in limiters)
        raise ConcurrencyConfigError(
            f"limiters {_names(limiters)} cannot be held together: they are of different "
            f"backends ({backends}); a request over several limiters needs them all in one",
            limiter=first.name,
        )
    if not supports(first, SupportsMembers):
        raise ConcurrencyConfigError(
            f"limiters {_names(limiters)} cannot be held together: {type(first).__name__} "
            "cannot grant one request over several limiters (it does not implement "
            "SupportsMembers)",
            limiter=first.name,
        )


def default_key(limiters: Sequence[ConcurrencyLimiter]) -> str | None:
    for limiter in limiters:
        _, key = split_key_name(limiter.name)
        if key is not None:
            return key
    return None


def validate_workload(limiter: ConcurrencyLimiter, workload: str | None) -> str:
    if supports(limiter, SupportsValidateWorkload):
        return cast(SupportsValidateWorkload, limiter).validate_workload(workload)
    return workload or DEFAULT_WORKLOAD


def has_workload(limiter: ConcurrencyLimiter, workload: str) -> bool:
    if supports(limiter, SupportsConfig):
        return workload in cast(SupportsConfig, limiter).config.workloads
    try:
        validate_workload(limiter, workload)
    except ConcurrencyConfigError:
        return False
    return True


def resolve_workloads(
    limiters: Sequence[ConcurrencyLimiter], workload: str | None, *, strict: bool = False
) -> tuple[str, ...]:
    """The workload a request selecting ``workload`` uses in each limiter: that one
    where a limiter has it, its default elsewhere (``strict``: each must have it)."""
    if strict:
        return tuple(validate_workload(limiter, workload) for limiter in limiters)
    present = [workload is not None and has_workload(limiter, workload) for limiter in limiters]
    if workload is not None and not any(present):
        raise ConcurrencyConfigError(
            f"workload {workload!r} exists in none of the limiters {_names(limiters)}",
            limiter=limiters[0].name,
            workload=workload,
        )
    return tuple(
        validate_workload(limiter, workload if here else None)
        for limiter, here in zip(limiters, present, strict=True)
    )
