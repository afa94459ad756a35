"""Every code block in README.md runs, as a reader would run it.

* ``python`` blocks: each in a fresh interpreter, with ``DATABASE_URL`` (a database of
  this test's own), ``REDIS_URL`` and ``PROVIDER_URL`` (a fake provider) set. A block
  that sends a Celery task (``app`` and ``result``) gets a real worker for its app, and
  the result is awaited; a block that defines ``RUNCELL`` has it validated.
* ``sh`` blocks: each command line. ``./demo`` runs in its CI form (``--no-serve --size
  small``, on this test's database) and must show the limit held; the benchmarks run
  with small sizes; the fake provider is started, asked for its health and stopped;
  ``scripts/test`` is the command running this very test (``.ci/run`` calls it).
* ``text`` blocks are sample output and are not run.

A command the test does not know fails it, so a new README block needs a way to run.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from runcell_celery.testing import FakeProvider
from tests.support.demo import demo_environment, run_demo, summary
from tests.support.pg import create_database, drop_database

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
#: A Redis database of the README test's own: its Celery block uses the default queue.
REDIS_URL = os.environ.get("RUNCELL_TEST_README_REDIS", "redis://127.0.0.1:6379/15")

DRIVER = """
import sys
namespace = {"__name__": "readme"}
exec(compile(sys.stdin.read(), "README.md", "exec"), namespace)
app, result = namespace.get("app"), namespace.get("result")
if app is not None and result is not None:
    from celery.contrib.testing.worker import start_worker
    with start_worker(app, pool="threads", concurrency=2, perform_ping_check=False,
                      loglevel="WARNING"):
        print("celery result:", result.get(timeout=60))
if "RUNCELL" in namespace and "ConcurrencyConfigError" not in namespace:
    from runcell_celery.registry import LimiterRegistry
    LimiterRegistry().configure(namespace["RUNCELL"])
    print("RUNCELL is valid")
"""

#: Small sizes for the benchmarks: the test checks that they run, not their figures.
BENCH_ARGS = {
    "bench/slot_overhead.py": ["--ops", "2000", "--rounds", "2"],
    "bench/postgres_engine.py": ["--size", "small", "--only", "cycles,tables"],
    "bench/celery_overhead.py": ["--size", "small"],
}


def readme_blocks(language: str) -> list[tuple[int, str]]:
    """``(line number, code)`` of each fenced block in ``language``."""
    text = README.read_text()
    return [
        (text[: match.start()].count("\n") + 1, match.group(2))
        for match in FENCE.finditer(text)
        if match.group(1) == language
    ]


def test_readme_has_only_blocks_this_test_can_run() -> None:
    languages = {m.group(1) for m in FENCE.finditer(README.read_text())}
    assert languages <= {"python", "sh", "text"}, languages
    assert readme_blocks("python")
    assert readme_blocks("sh")


@pytest.fixture(scope="module")
def block_env() -> Iterator[dict[str, str]]:
    database = create_database("runcell_readme")
    with FakeProvider(latency_ms=5) as provider:
        yield {
            **os.environ,
            "DATABASE_URL": database,
            "REDIS_URL": REDIS_URL,
            "PROVIDER_URL": provider.url,
            "PYTHONPATH": str(ROOT),
        }
    drop_database(database)


@pytest.mark.parametrize(
    ("line", "code"),
    readme_blocks("python"),
    ids=lambda v: f"line-{v}" if isinstance(v, int) else "",
)
def test_readme_python_block_runs(line: int, code: str, block_env: dict[str, str]) -> None:
    done = subprocess.run(
        [sys.executable, "-c", DRIVER],
        input=code.encode(),
        env=block_env,
        cwd=ROOT,
        capture_output=True,
        timeout=120,
        check=False,
    )
    output = (done.stdout + done.stderr).decode(errors="replace")
    assert done.returncode == 0, f"README.md block at line {line} failed:\n{code}\n{output}"
    if "apply_async" in code:
        assert "celery result:" in output  # a worker ran the task the block sent
    if "RUNCELL = " in code and "ConcurrencyConfigError" not in code:
        assert "RUNCELL is valid" in output


def test_readme_runcell_block_is_the_example_projects_setting() -> None:
    (block,) = [code for _, code in readme_blocks("python") if '"provider"' in code]
    shown: dict[str, object] = {}
    exec(block, shown)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNCELL_DEMO_")}
    actual = subprocess.run(
        [
            sys.executable,
            "-c",
            "import json, example_project.settings as s; print(json.dumps(s.RUNCELL))",
        ],
        cwd=ROOT / "example_project",
        env=env,
        capture_output=True,
        check=True,
    )
    assert json.loads(actual.stdout) == json.loads(json.dumps(shown["RUNCELL"]))


def sh_commands() -> list[str]:
    commands = []
    for _, code in readme_blocks("sh"):
        for raw in code.splitlines():
            line = raw.split(" #", 1)[0].strip()
            if line and not line.startswith("#"):
                commands.append(line)
    return commands


def test_readme_commands_are_all_known() -> None:
    for command in sh_commands():
        argv = shlex.split(command)
        known = (
            argv[0] in ("./demo", "scripts/test")
            or (argv[0] == ".venv/bin/python" and argv[1] in BENCH_ARGS)
            or argv[1:3] == ["-m", "runcell_celery.testing.fake_provider"]
        )
        assert known, f"README.md command with no way to run it here: {command}"


def test_readme_test_command_is_what_ci_runs() -> None:
    assert "scripts/test" in sh_commands()
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert any("scripts/test" in line and not line.lstrip().startswith("#") for line in ci)


def test_readme_demo_command_runs_and_the_limit_holds() -> None:
    variants = {tuple(shlex.split(c)[1:]) for c in sh_commands() if c.startswith("./demo")}
    assert () in variants, "README shows ./demo itself"
    # The CI form of every ./demo line (serving lines run in tests/demo and tests/browser).
    args = ["--no-serve", "--size", "small"]
    assert tuple(args) in variants
    with demo_environment() as env:
        code, output = run_demo(args, env)
        assert code == 0, output
        result = summary(env)
    assert result["limit_held"], output
    assert 1 <= result["provider"]["max_in_flight"] <= result["limit"] == 4
    assert result["tasks"]["succeeded"] == result["tasks"]["expected"]
    assert "-> the limit held" in output


#: The benches that start workers and databases take a minute between them: they run
#: with the stress suite (which CI runs too), the quick one by default.
SLOW_BENCHES = {"bench/celery_overhead.py", "bench/postgres_engine.py"}


@pytest.mark.parametrize(
    "script",
    [
        pytest.param(script, marks=[pytest.mark.stress] if script in SLOW_BENCHES else [])
        for script in sorted(BENCH_ARGS)
    ],
)
def test_readme_benchmark_runs(script: str) -> None:
    assert any(c.endswith(script) for c in sh_commands())
    done = subprocess.run(
        [str(ROOT / ".venv/bin/python"), script, *BENCH_ARGS[script]],
        cwd=ROOT,
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    assert isinstance(json.loads(done.stdout), dict)


def test_readme_fake_provider_command_serves_until_stopped() -> None:
    (command,) = [c for c in sh_commands() if "runcell_celery.testing.fake_provider" in c]
    argv = shlex.split(command)
    proc = subprocess.Popen(
        [str(ROOT / argv[0]), *argv[1:]],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().decode().strip()
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(f"{url}/health", timeout=10) as response:
            assert json.loads(response.read()) == {"status": "ok"}
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
    assert proc.returncode == 0
    assert "max_in_flight" in err.decode()
