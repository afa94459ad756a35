"""slot() cycles/s of two commits, measured in turn in one run, as one JSON object.

Checks out ``--base`` (a commit, by default ``HEAD~1``) beside this work tree, then runs
``bench/postgres_engine.py --only cycles --cycles-project-only`` alternately against the
base checkout and this one (``PYTHONPATH`` picks which ``runcell_celery`` is imported;
each run makes its own database with that commit's schema). Alternating, and taking the
median of the rounds, keeps the machine's drift out of the ratio, which is what to read:
``ratio`` = this tree's cycles/s over the base's, per shape.

    python bench/compare_commits.py --base 2f2d4d5 --rounds 3
    python bench/compare_commits.py --size small --rounds 1   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent.parent


def progress(message: str) -> None:
    print(f"[compare] {message}", file=sys.stderr, flush=True)


def cycles(checkout: Path, size: str) -> dict[str, float]:
    """One pass over every shape with ``checkout``'s package: cycles/s per shape."""
    env = dict(os.environ, PYTHONPATH=str(checkout))
    command = [
        sys.executable, str(HERE / "bench" / "postgres_engine.py"), "--only", "cycles",
        "--cycles-project-only", "--rounds", "1", "--size", size,
    ]  # fmt: skip
    out = subprocess.run(command, env=env, capture_output=True, text=True, check=True).stdout
    report = json.loads(out)
    imported = Path(report["runcell_celery"]).resolve()
    if imported != (checkout / "runcell_celery").resolve():
        raise RuntimeError(f"expected runcell_celery from {checkout}, imported {imported}")
    return {shape: row["project_cycles_per_s"] for shape, row in report["cycles"].items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="HEAD~1", help="the commit to compare with")
    parser.add_argument("--rounds", type=int, default=3, help="passes per checkout")
    parser.add_argument("--size", choices=("small", "full"), default="full")
    args = parser.parse_args()
    base_commit = subprocess.run(
        ["git", "-C", str(HERE), "rev-parse", "--short", args.base],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    head_commit = subprocess.run(
        ["git", "-C", str(HERE), "rev-parse", "--short", "HEAD"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    runs: dict[str, dict[str, list[float]]] = {"base": {}, "head": {}}
    with tempfile.TemporaryDirectory(prefix="runcell-bench-base-") as scratch:
        base = Path(scratch) / "base"
        subprocess.run(
            ["git", "-C", str(HERE), "worktree", "add", "--detach", str(base), base_commit],
            capture_output=True, check=True,
        )  # fmt: skip
        try:
            for number in range(args.rounds):
                # Alternate which goes first, so neither always meets a warmer machine.
                order = [("base", base), ("head", HERE)]
                for side, checkout in order if number % 2 == 0 else order[::-1]:
                    progress(f"round {number + 1}/{args.rounds}: {side}")
                    for shape, value in cycles(checkout, args.size).items():
                        runs[side].setdefault(shape, []).append(value)
        finally:
            subprocess.run(
                ["git", "-C", str(HERE), "worktree", "remove", "--force", str(base)],
                capture_output=True, check=False,
            )  # fmt: skip
    shapes: dict[str, Any] = {}
    for shape, values in runs["head"].items():
        before = statistics.median(runs["base"][shape])
        after = statistics.median(values)
        shapes[shape] = {
            "base_cycles_per_s": round(before, 1),
            "head_cycles_per_s": round(after, 1),
            "ratio": round(after / before, 3),
            "base_rounds": runs["base"][shape],
            "head_rounds": values,
        }
    report = {
        "base": base_commit,
        "head": head_commit,
        "rounds": args.rounds,
        "size": args.size,
        "load_average_end": os.getloadavg(),
        "lowest_ratio": min(row["ratio"] for row in shapes.values()),
        "shapes": shapes,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
