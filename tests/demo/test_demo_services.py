"""``./demo`` finds its services, or starts embedded ones, and the limit holds either way."""

from __future__ import annotations

import fcntl
import shutil
from pathlib import Path

import pytest

from tests.support.demo import demo_environment, processes_mentioning, run_demo, summary

pytestmark = pytest.mark.timeout(300)


def test_demo_falls_back_to_embedded_services_when_nothing_answers() -> None:
    """The environment points nowhere and localhost is not asked: embedded servers run
    the whole demo, and the provider's own count shows the limit held."""
    with demo_environment(own_database=False) as env:
        env["RUNCELL_DEMO_DATABASE_URL"] = "postgresql://postgres@127.0.0.1:1/nowhere"
        env["RUNCELL_DEMO_REDIS_URL"] = "redis://127.0.0.1:1/0"
        code, output = run_demo(["--no-serve", "--size", "small", "--no-localhost"], env)
        assert code == 0, output
        result = summary(env)
        home = Path(env["RUNCELL_DEMO_HOME"])
        assert (home / "pgdata" / "PG_VERSION").exists()
        left = processes_mentioning(str(home))
        shutil.rmtree(home / "pgdata")  # owned by the server's user when run as root
    assert "127.0.0.1:1/nowhere (RUNCELL_DEMO_DATABASE_URL) does not answer" in output
    assert "127.0.0.1:1/0 (RUNCELL_DEMO_REDIS_URL) does not answer" in output
    assert result["services"]["database_source"] == "embedded"
    assert result["services"]["redis_source"] == "embedded"
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
