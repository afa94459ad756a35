"""Ctrl-C stops every process ``./demo`` started, and nothing it did not start."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import psycopg
import pytest

from tests.support.demo import DemoProcess, demo_environment, process_groups, processes_mentioning
from tests.support.pg import ADMIN_DSN

# Whole demo runs (about a minute together): in the stress suite, which CI runs too.
pytestmark = [pytest.mark.timeout(300), pytest.mark.stress]


def _gone(pids: list[int], timeout: float = 10) -> list[int]:
    deadline = time.monotonic() + timeout
    while (left := process_groups(pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def test_ctrl_c_stops_every_process_the_demo_started_and_nothing_else() -> None:
    # A process the demo did not start, in a session of its own like the demo's children.
    bystander = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        with demo_environment() as env:
            demo = DemoProcess(["--size", "small", "--port", "0"], env)
            try:
                demo.wait_for_line("admin is up")
                state = demo.state()
                started = {p["name"]: p["pid"] for p in state["processes"]}
                # Pool processes and the like: every member of the demo's process groups.
                members = process_groups(list(started.values()))
                code = demo.interrupt()
            finally:
                demo.kill()
            home = Path(env["RUNCELL_DEMO_HOME"])
            assert code == 130, demo.output
            assert {"fake-provider", "worker-1", "worker-2", "django"} <= set(started)
            assert len(members) > len(started)  # the workers' prefork children too
            assert _gone(list(started.values())) == []
            assert processes_mentioning(env["RUNCELL_DEMO_QUEUE_PREFIX"]) == []
            assert processes_mentioning(str(home)) == []
            assert not (home / "state.json").exists()
            assert "demo: stopped." in demo.output
        assert bystander.poll() is None, "the demo stopped a process it did not start"
        with psycopg.connect(ADMIN_DSN, connect_timeout=5) as conn:  # nor the local server
            conn.execute("SELECT 1")
    finally:
        bystander.send_signal(signal.SIGKILL)
        bystander.wait(10)


def test_a_killed_demo_leaves_processes_the_next_run_stops() -> None:
    """SIGKILL gives the demo no chance to clean up; its state file lets the next run."""
    with demo_environment() as env:
        demo = DemoProcess(["--size", "small", "--port", "0"], env)
        try:
            demo.wait_for_line("admin is up")
            started = [p["pid"] for p in demo.state()["processes"]]
            demo.popen.send_signal(signal.SIGKILL)
            demo.popen.wait(10)
            assert process_groups(started), "its processes outlive a killed demo"
            rerun = DemoProcess(["--no-serve", "--size", "small"], env)
            line = rerun.wait_for_line("demo: stopped what an earlier run left behind")
            assert rerun.popen.wait(180) == 0, rerun.output
        finally:
            demo.kill()
        assert "worker-1" in line
        assert _gone(started) == []
