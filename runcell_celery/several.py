"""Several limiters in one request: what may be held together, and with which workload.

``slot(openai, gpt_4o, tenants.key("acme"))`` and ``run(limiter=[openai, tenant_key])``
name several limiters; the checks here run before anything waits, for both:

* :func:`check_several`: no keyed limiter itself (a slot names one of its keys), no
  limiter twice, and all of one backend that can hold them together
  (:class:`~runcell_celery.protocol.SupportsSeveral`).
* :func:`resolve_workloads`: the selected workload applies in each limiter that has
  it, that limiter's default in the others (allocation's rule,
  :func:`~runcell_celery.allocation.allocate_several`).
* :func:`default_key`: the fairness key of a request that gives none, the key of a
  key's limiter it names (``"tenant:acme"`` -> ``"acme"``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from .errors import ConcurrencyConfigError
from .keys import is_keyed, split_key_name
from .protocol import (
    ConcurrencyLimiter,
    SupportsConfig,
    SupportsSeveral,
    SupportsValidateWorkload,
    supports,
)

__all__ = ["check_several", "default_key", "resolve_workloads"]


def _names(limiters: Sequence[ConcurrencyLimiter]) -> str:
    return ", ".join(repr(limiter.name) for limiter in limiters)


def check_several(limiters: Sequence[ConcurrencyLimiter]) -> None:
    """Raise unless ``limiters`` can be held together in one request.

    :raises ConcurrencyConfigError: a keyed limiter itself, the same limiter (or name)
        twice, or limiters of different backends or of a backend that cannot hold
        several together.
    """
    for limiter in limiters:
        if is_keyed(limiter):
            name = limiter.name
            raise ConcurrencyConfigError(
                f"limiter {name!r} is keyed: it has a limit per key and no slots of its own; "
                f"name one of its keys, {name}.key(...), e.g. slot(..., {name}.key(tenant_id))",
                limiter=name,
            )
    seen: dict[str, ConcurrencyLimiter] = {}
    for limiter in limiters:
        if limiter.name in seen:
            raise ConcurrencyConfigError(
                f"limiters {_names(limiters)}: {limiter.name!r} is named twice; a request "
                "takes one slot in each limiter, so name each once",
                limiter=limiter.name,
            )
        seen[limiter.name] = limiter
    first = limiters[0]
    kinds = {type(limiter) for limiter in limiters}
    if len(kinds) > 1:
        backends = ", ".join(f"{x.name!r} ({type(x).__name__})" for x in limiters)
        raise ConcurrencyConfigError(
            f"limiters {_names(limiters)} cannot be held together: they are of different "
            f"backends ({backends}); a request over several limiters needs them all in one",
            limiter=first.name,
        )
    if not supports(first, SupportsSeveral):
        raise ConcurrencyConfigError(
            f"limiters {_names(limiters)} cannot be held together: {type(first).__name__} "
            "cannot grant one request over several limiters (it does not implement "
            "SupportsSeveral)",
            limiter=first.name,
        )


def default_key(limiters: Sequence[ConcurrencyLimiter]) -> str | None:
    """The key of the first key's limiter among ``limiters`` (``"tenant:acme"``), if any."""
    for limiter in limiters:
        _, key = split_key_name(limiter.name)
        if key is not None:
            return key
    return None


def _has(limiter: ConcurrencyLimiter, workload: str) -> bool:
    if supports(limiter, SupportsConfig):
        return workload in cast(SupportsConfig, limiter).config.workloads
    if supports(limiter, SupportsValidateWorkload):
        try:
            cast(SupportsValidateWorkload, limiter).validate_workload(workload)
        except ConcurrencyConfigError:
            return False
    return True


def _default(limiter: ConcurrencyLimiter) -> str:
    if supports(limiter, SupportsValidateWorkload):
        return cast(SupportsValidateWorkload, limiter).validate_workload(None)
    return "default"


def resolve_workloads(
    limiters: Sequence[ConcurrencyLimiter], workload: str | None
) -> tuple[str, ...]:
    """The workload a request selecting ``workload`` uses in each limiter.

    In each limiter that has ``workload``, that one; in the others (and everywhere when
    ``workload`` is ``None``) the limiter's default.

    :raises ConcurrencyConfigError: ``workload`` exists in none of the limiters (a
        typo), or a limiter that needs the default has none (several workloads and no
        ``default_workload``).
    """
    present = [workload is not None and _has(limiter, workload) for limiter in limiters]
    if workload is not None and not any(present):
        raise ConcurrencyConfigError(
            f"workload {workload!r} exists in none of the limiters {_names(limiters)}",
            limiter=limiters[0].name,
            workload=workload,
        )
    return tuple(
        cast(str, workload) if here else _default(limiter)
        for limiter, here in zip(limiters, present, strict=True)
    )
