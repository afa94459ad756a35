"""``./demo`` finds its services, or starts embedded ones, and the limit holds either way."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from tests.support.demo import (
    ROOT,
    demo_environment,
    private_checkout,
    processes_mentioning,
    run_demo,
)

# Appended, not prepended: example_project/tests would otherwise shadow this suite's
# own `tests` namespace in every process spawned later in the run.
sys.path.append(str(ROOT / "example_project"))
from demo.embedded import reachable_dir  # the demo's own package
from demo.paths import Paths

pytestmark = pytest.mark.timeout(300)


# A whole demo run from a fresh copy with its own virtualenv (over 20 s): in the stress
# suite, which CI runs too.
@pytest.mark.stress
def test_demo_falls_back_to_embedded_services_from_a_checkout_only_root_may_enter() -> None:
    """The environment points nowhere and localhost is not asked: embedded servers run
    the whole demo, and the provider's own count shows the limit held. Run as root (the
    tests' user here) from a fresh copy in a 0700 directory, where the embedded
    PostgreSQL's user reaches neither the binaries in the copy's virtualenv nor its
    ``.runcell/``: they go to a directory of the demo's own that it can reach."""
    assert os.geteuid() == 0, "this test is about running the demo as root"
    with private_checkout() as (checkout, env):
        assert checkout.parent.stat().st_mode & 0o777 == 0o700
        env["RUNCELL_DEMO_DATABASE_URL"] = "postgresql://postgres@127.0.0.1:1/nowhere"
        env["RUNCELL_DEMO_REDIS_URL"] = "redis://127.0.0.1:1/0"
        home = checkout / ".runcell"
        place = reachable_dir(Paths(home.resolve()))
        try:
            code, output = run_demo(
                ["--no-serve", "--size", "small", "--no-localhost"], env, demo=checkout / "demo"
            )
            assert code == 0, output
            result = json.loads((home / "summary.json").read_text())
            data_kept = (place / "pgdata" / "PG_VERSION").exists()
            binaries_copied = (place / "pgserver" / "pginstall" / "bin" / "postgres").exists()
            left = processes_mentioning(str(checkout)) + processes_mentioning(str(place))
        finally:
            shutil.rmtree(place, ignore_errors=True)
    assert "127.0.0.1:1/nowhere (RUNCELL_DEMO_DATABASE_URL) does not answer" in output
    assert "127.0.0.1:1/0 (RUNCELL_DEMO_REDIS_URL) does not answer" in output
    assert result["services"]["database_source"] == "embedded"
    assert result["services"]["redis_source"] == "embedded"
    assert data_kept
    assert binaries_copied
    assert result["limit_held"]
    assert 1 <= result["provider"]["max_in_flight"] <= result["limit"]
    assert result["tasks"]["succeeded"] == result["tasks"]["expected"]
    assert left == [], "embedded servers outlived the demo"


def test_demo_refuses_to_run_twice_in_one_home() -> None:
    with demo_environment(own_database=False) as env:
        lock = Path(env["RUNCELL_DEMO_HOME"]) / "demo.lock"
        with open(lock, "w") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            code, output = run_demo(["--no-serve", "--size", "small"], env, timeout=60)
    assert code == 2
    assert "another ./demo" in output
