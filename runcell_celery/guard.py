"""``guard``: a decorator that holds one slot around every call of a provider function.

Plain and ``async`` functions hold the slot for the call; generators and async
generators hold it until the stream is exhausted or closed, as a streamed response
should (a slot covers response streaming).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any, ParamSpec, TypeVar, overload

from .arguments import check_limiter_list, check_slot_arguments
from .errors import ConcurrencyConfigError
from .protocol import ConcurrencyLimiter
from .slot import Slot

__all__ = ["guard"]

P = ParamSpec("P")
R = TypeVar("R")


@overload
def guard(fn: Callable[P, R], /) -> Callable[P, R]: ...


@overload
def guard(
    fn: None = None,
    /,
    *,
    limiter: ConcurrencyLimiter | Sequence[ConcurrencyLimiter] | None = None,
    workload: str | None = None,
    key: str | None = None,
    max_hold_ms: int | None = None,
) -> Callable[[Callable[P, R]], Callable[P, R]]: ...


def guard(
    fn: Callable[P, R] | None = None,
    /,
    *,
    limiter: ConcurrencyLimiter | Sequence[ConcurrencyLimiter] | None = None,
    workload: str | None = None,
    key: str | None = None,
    max_hold_ms: int | None = None,
) -> Callable[P, R] | Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorate a provider-call function so that every call holds one slot::

        @guard(limiter=claude)
        def complete(prompt: str) -> str: ...

        @guard
        async def stream(prompt: str) -> AsyncIterator[str]: ...   # run's limiter

    ``limiter`` may be a sequence (as ``slot(a, b)``). Bad arguments raise
    ``ConcurrencyConfigError`` when decorating.
    """
    limiters = check_limiter_list(limiter, argument="guard(limiter)")
    check_slot_arguments("guard", limiters, workload, key, max_hold_ms, None, None)

    def decorate(func: Callable[P, R]) -> Callable[P, R]:
        if not callable(func):
            raise ConcurrencyConfigError(
                f"guard(fn) = {func!r:.60} is invalid: must be a function (the provider call)"
            )

        def make() -> Slot:  # call=None: the arguments were checked above
            return Slot.__new__(Slot)._setup(limiters, workload, key, max_hold_ms, None, None, None)

        wrapper: Callable[..., Any]
        if inspect.isasyncgenfunction(func):

            async def wrapper(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
                async with make() as held:
                    stream = func(*args, **kwargs)
                    try:
                        # An abort cancels the task only while the stream reads; one
                        # while the consumer has the item ends it at its next step.
                        while not held.aborted:
                            try:
                                with held.interruptible():
                                    item = await anext(stream)
                            except StopAsyncIteration:
                                break
                            yield item
                    finally:
                        await stream.aclose()

        elif inspect.iscoroutinefunction(func):

            async def wrapper(*args: Any, **kwargs: Any) -> Any:
                async with make():
                    return await func(*args, **kwargs)

        elif inspect.isgeneratorfunction(func):

            def wrapper(*args: Any, **kwargs: Any) -> Iterator[Any]:
                with make():
                    yield from func(*args, **kwargs)

        else:

            def wrapper(*args: Any, **kwargs: Any) -> Any:
                with make():
                    return func(*args, **kwargs)

        return functools.wraps(func)(wrapper)

    return decorate if fn is None else decorate(fn)
