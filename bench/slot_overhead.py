"""What one uncontended slot costs: ``slot()`` enter+exit against a bare ``threading.Semaphore``.

Both run in the same process and the same run, interleaved in rounds, so machine
noise hits both alike; the figures to read are the ratio and the per-op times.

Tracing (``runcell_celery.tracing``): with ``opentelemetry-api`` installed and no tracer
provider set, ``slot`` runs the tracing hooks, which find nobody tracing and build no
span. ``slot_without_tracing_hooks`` is the same slot with the hooks replaced by stubs
that return at once, interleaved with it: ``tracing_hooks_overhead_us`` is what the
hooks cost a slot cycle with no provider (within the machine's noise).
``disabled_hook_check_ns`` times the check alone (the hook against a stub, best of
several runs), which noise disturbs least. ``slot_with_tracer_provider`` (run last,
when the OpenTelemetry SDK is installed: a provider cannot be unset) builds both spans
per slot, with no exporter.

    python bench/slot_overhead.py [--ops 20000] [--rounds 15]

Prints one JSON object (per-op µs: median, p95 over rounds; ratio of medians).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import platform
import statistics
import sys
import threading
import time
import timeit
from collections.abc import Callable, Iterator
from typing import Any

from runcell_celery import create_concurrency_limiter, run, slot, tracing


def _per_op_us(body: Callable[[], None], ops: int) -> float:
    started = time.perf_counter()
    for _ in range(ops):
        body()
    return (time.perf_counter() - started) / ops * 1e6


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


#: The hooks the slot runtime calls (module attributes, looked up at each call).
_HOOKS = ("start_hold", "wait_failed", "wait_ended", "wait_granted", "wait_deferred")


def _stub(*args: Any) -> None:
    return None


@contextlib.contextmanager
def _without_tracing_hooks() -> Iterator[None]:
    """The slot runtime as if it had no tracing: every hook returns at once."""
    saved = {name: getattr(tracing, name) for name in _HOOKS}
    for name in _HOOKS:
        setattr(tracing, name, _stub)
    try:
        yield
    finally:
        for name, hook in saved.items():
            setattr(tracing, name, hook)


def _hook_check_ns() -> float:
    """ns one slot's tracing hook costs with no provider, beyond calling a stub (the
    best of several timings: the least disturbed by the machine)."""
    args = (None, None, 0.0, None)  # never read: the hook returns before
    hook = tracing.start_hold
    number = 200_000
    hooked = min(timeit.repeat(lambda: hook(*args), number=number, repeat=7))  # type: ignore[arg-type]
    stubbed = min(timeit.repeat(lambda: _stub(*args), number=number, repeat=7))
    return (hooked - stubbed) / number * 1e9


def _with_tracer_provider(body: Callable[[], None], ops: int, rounds: int) -> list[float] | None:
    """Per-op µs of ``body`` once an SDK tracer provider is set (no exporter); ``None``
    without the SDK."""
    if importlib.util.find_spec("opentelemetry.sdk") is None:
        return None
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    trace.set_tracer_provider(TracerProvider())
    assert tracing.current_tracer() is not None
    _per_op_us(body, min(ops, 2000))
    return [_per_op_us(body, ops) for _ in range(rounds)]


def _summary(values: list[float]) -> dict[str, float]:
    return {
        "median_us": round(statistics.median(values), 3),
        "p95_us": round(_percentile(values, 0.95), 3),
        "min_us": round(min(values), 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=20_000, help="operations per round")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved rounds")
    args = parser.parse_args(argv)

    semaphore = threading.Semaphore(8)
    limiter = create_concurrency_limiter(8, name="bench")

    def bare() -> None:
        with semaphore:
            pass

    def wrapped() -> None:
        with slot(limiter):
            pass

    def wrapped_in_run() -> None:
        with slot():
            pass

    def wrapped_without_hooks() -> None:
        with _without_tracing_hooks():
            for _ in range(args.ops):
                wrapped()

    cases: dict[str, Callable[[], None]] = {"semaphore": bare, "slot": wrapped}
    names = [*cases, "slot_in_run", "slot_without_tracing_hooks"]
    samples: dict[str, list[float]] = {name: [] for name in names}
    assert tracing.current_tracer() is None, "the bench starts with no tracer provider"
    for body in cases.values():  # warm-up
        _per_op_us(body, min(args.ops, 2000))
    with run(limiter=limiter):
        for round_ in range(args.rounds):
            for name, body in cases.items():
                samples[name].append(_per_op_us(body, args.ops))
            samples["slot_in_run"].append(_per_op_us(wrapped_in_run, args.ops))
            samples["slot_without_tracing_hooks"].append(_per_op_us(wrapped_without_hooks, 1))
            # Once more, after it: neither side of the comparison always goes first.
            samples["slot"].append(_per_op_us(wrapped, args.ops))
            print(f"round {round_ + 1}/{args.rounds}", file=sys.stderr, flush=True)
    # The per-op time of a body that ran ``ops`` slots in one call.
    samples["slot_without_tracing_hooks"] = [
        v / args.ops for v in samples["slot_without_tracing_hooks"]
    ]
    check_ns = _hook_check_ns()
    traced = _with_tracer_provider(wrapped, args.ops, args.rounds)
    if traced is not None:
        samples["slot_with_tracer_provider"] = traced

    summary = {name: _summary(values) for name, values in samples.items()}
    base = summary["semaphore"]["median_us"]
    untraced = summary["slot_without_tracing_hooks"]["median_us"]
    hooks_overhead_us = summary["slot"]["median_us"] - untraced
    result = {
        "benchmark": "uncontended slot() enter+exit vs threading.Semaphore",
        "python": platform.python_version(),
        "ops_per_round": args.ops,
        "rounds": args.rounds,
        "per_op": summary,
        "ratio_slot_to_semaphore": round(summary["slot"]["median_us"] / base, 2),
        "ratio_slot_in_run_to_semaphore": round(summary["slot_in_run"]["median_us"] / base, 2),
        "slot_overhead_us": round(summary["slot"]["median_us"] - base, 3),
        "tracing": {
            "opentelemetry_imported": tracing.OTEL_AVAILABLE,
            "tracer_provider_during_rounds": "none (the API's default proxy)",
            "tracing_hooks_overhead_us": round(hooks_overhead_us, 3),
            "tracing_hooks_overhead_pct": round(100 * hooks_overhead_us / untraced, 2),
            "disabled_hook_check_ns": round(check_ns, 1),
            "disabled_hook_check_pct_of_slot": round(
                100 * check_ns / 1000 / summary["slot"]["median_us"], 2
            ),
            "ratio_slot_to_slot_without_tracing_hooks": round(
                summary["slot"]["median_us"] / untraced, 3
            ),
            "ratio_of_minimums_slot_to_slot_without_tracing_hooks": round(
                summary["slot"]["min_us"] / summary["slot_without_tracing_hooks"]["min_us"], 3
            ),
            "ratio_slot_with_tracer_provider_to_slot": (
                round(
                    summary["slot_with_tracer_provider"]["median_us"]
                    / summary["slot"]["median_us"],
                    2,
                )
                if traced is not None
                else None
            ),
        },
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
