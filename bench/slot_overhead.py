"""What one uncontended slot costs: ``slot()`` enter+exit against a bare ``threading.Semaphore``.

Both run in the same process and the same run, interleaved in rounds, so machine
noise hits both alike; the figures to read are the ratio and the per-op times.

    python bench/slot_overhead.py [--ops 20000] [--rounds 15]

Prints one JSON object (per-op µs: median, p95 over rounds; ratio of medians).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable

from runcell_celery import create_concurrency_limiter, run, slot


def _per_op_us(body: Callable[[], None], ops: int) -> float:
    started = time.perf_counter()
    for _ in range(ops):
        body()
    return (time.perf_counter() - started) / ops * 1e6


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


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

    cases: dict[str, Callable[[], None]] = {"semaphore": bare, "slot": wrapped}
    samples: dict[str, list[float]] = {name: [] for name in [*cases, "slot_in_run"]}
    for body in cases.values():  # warm-up
        _per_op_us(body, min(args.ops, 2000))
    with run(limiter=limiter):
        for round_ in range(args.rounds):
            for name, body in cases.items():
                samples[name].append(_per_op_us(body, args.ops))
            samples["slot_in_run"].append(_per_op_us(wrapped_in_run, args.ops))
            print(f"round {round_ + 1}/{args.rounds}", file=sys.stderr, flush=True)

    summary = {
        name: {
            "median_us": round(statistics.median(values), 3),
            "p95_us": round(_percentile(values, 0.95), 3),
            "min_us": round(min(values), 3),
        }
        for name, values in samples.items()
    }
    base = summary["semaphore"]["median_us"]
    result = {
        "benchmark": "uncontended slot() enter+exit vs threading.Semaphore",
        "python": platform.python_version(),
        "ops_per_round": args.ops,
        "rounds": args.rounds,
        "per_op": summary,
        "ratio_slot_to_semaphore": round(summary["slot"]["median_us"] / base, 2),
        "ratio_slot_in_run_to_semaphore": round(summary["slot_in_run"]["median_us"] / base, 2),
        "slot_overhead_us": round(summary["slot"]["median_us"] - base, 3),
    }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
