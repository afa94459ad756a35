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
* The blocks of "Use it in your Django project" are files of a project, not scripts:
  ``test_readme_quickstart_builds_a_project_whose_worker_keeps_the_limit`` writes them
  into a project made by ``django-admin startproject`` (the first line of each names
  its file) and runs the section's commands in it; the ``pip install`` line's extras
  must exist, and the stress suite runs it in a fresh virtualenv.

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
import tomllib
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from runcell_celery.testing import FakeProvider
from tests.support.demo import demo_environment, run_demo, summary
from tests.support.django_project import DjangoProject
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


#: The README section whose blocks are a Django project's files and commands.
QUICKSTART = "## Use it in your Django project\n"


def _quickstart_span(text: str) -> tuple[int, int]:
    start = text.index(QUICKSTART)
    return start, text.index("\n## ", start + len(QUICKSTART))


def readme_blocks(language: str, *, quickstart: bool | None = False) -> list[tuple[int, str]]:
    """``(line number, code)`` of each fenced block in ``language``: those outside the
    quickstart section (``quickstart=False``), inside it (``True``), or all (``None``)."""
    text = README.read_text()
    start, end = _quickstart_span(text)
    return [
        (text[: match.start()].count("\n") + 1, match.group(2))
        for match in FENCE.finditer(text)
        if match.group(1) == language
        and (quickstart is None or (start < match.start() < end) == quickstart)
    ]


def test_readme_has_only_blocks_this_test_can_run() -> None:
    languages = {m.group(1) for m in FENCE.finditer(README.read_text())}
    assert languages <= {"python", "sh", "text"}, languages
    assert readme_blocks("python")
    assert readme_blocks("sh")
    for line, code in readme_blocks("python", quickstart=True):
        assert FILE_LINE.match(code), f"quickstart block at line {line} names no file"


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


def sh_commands(*, quickstart: bool | None = None) -> list[str]:
    commands = []
    for _, code in readme_blocks("sh", quickstart=quickstart):
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
            or argv[1:3] == ["-m", "runcell_celery.metrics"]
            # Run by the quickstart tests; migrate --database by test_checks_databases.
            or INSTALL.fullmatch(command) is not None
            or command in sh_commands(quickstart=True)
            or argv == ["python", "manage.py", "migrate", "--database", "runcell"]
            # Minutes each: CI runs them through scripts/test (see the nox test below).
            or argv[:2] == [".venv/bin/nox", "-s"]
        )
        assert known, f"README.md command with no way to run it here: {command}"


def test_readme_test_command_is_what_ci_runs() -> None:
    assert "scripts/test" in sh_commands()
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert any("scripts/test" in line and not line.lstrip().startswith("#") for line in ci)


def test_readme_nox_sessions_are_defined_and_run_by_ci() -> None:
    """Each session takes minutes, so this test does not run them: it checks that the
    README's ``nox -s`` lines name sessions noxfile.py defines and scripts/test runs."""
    shown = {shlex.split(c)[2] for c in sh_commands() if c.startswith(".venv/bin/nox -s ")}
    assert shown, "README shows how to run the nox sessions"
    listed = subprocess.run(
        [sys.executable, "-m", "nox", "-l", "--json"], cwd=ROOT, capture_output=True, check=True
    )
    defined = {session["name"] for session in json.loads(listed.stdout)}
    assert shown <= defined, f"noxfile.py defines {sorted(defined)}"
    (ci,) = [
        shlex.split(line)
        for line in (ROOT / "scripts" / "test").read_text().splitlines()
        if "bin/nox" in line and not line.lstrip().startswith("#")
    ]
    assert shown <= set(ci), f"scripts/test runs {ci}"


@pytest.mark.stress  # a whole demo run (about 20 s); CI runs the stress suite too
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


# -- "Use it in your Django project" ---------------------------------------------------

#: A quickstart block's first line names its file: ``# mysite/celery.py``.
FILE_LINE = re.compile(r"# (?P<path>[\w/]+\.py)\b")
#: The quickstart's install line (a package name and its extras).
INSTALL = re.compile(r'pip install "runcell-celery\[(?P<extras>[\w,]+)\]"')
#: What the test changes in the quickstart's settings, and only this: the database
#: and the Redis database are this test's own.
SETTINGS_HERE = {
    '"NAME": "mysite"': '"NAME": {dbname!r}',
    '"redis://127.0.0.1:6379/0"': "{redis!r}",
}
#: Run in the project with the quickstart's settings once its worker runs: sends a dozen
#: tasks and waits for them, and reads the admin's limiter page as a superuser.
SEND_TASKS = """
import json
from django.contrib.auth.models import User
from django.test import Client
from django.test.utils import setup_test_environment
from agents.tasks import summarize

results = [summarize.delay(f"document {i}") for i in range(12)]
replies = [result.get(timeout=90) for result in results]
setup_test_environment()
client = Client()
client.force_login(User.objects.create_superuser("admin", "admin@example.com", "pw"))
page = client.get("/admin/runcell_django/limiter/")
print("RESULT:" + json.dumps({"replies": replies, "admin": page.status_code,
                              "openai_in_admin": "openai" in page.content.decode()}))
"""


def quickstart_files() -> dict[str, str]:
    """The quickstart's python blocks by the file their first line names."""
    files = {}
    for line, code in readme_blocks("python", quickstart=True):
        named = FILE_LINE.match(code)
        assert named, f"quickstart block at line {line} names no file"
        files[named["path"]] = code
    return files


def test_readme_install_line_names_extras_that_exist() -> None:
    text = README.read_text()
    start = text.index(QUICKSTART)
    (install,) = INSTALL.findall(text[:start])
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert set(install.split(",")) <= set(declared)
    listed = set(re.findall(r"^\* `(\w+)` —", text[:start], re.MULTILINE))
    assert listed == set(declared) - {"dev"}, "the README lists every extra but dev"


def build_quickstart(root: Path, dbname: str, python: str = sys.executable) -> DjangoProject:
    """The quickstart's project: ``startproject``, ``startapp``, then its blocks."""
    project = DjangoProject(root, name="mysite", python=python)
    started = project.manage("startapp", "agents")
    assert started.returncode == 0, started.stderr
    files = quickstart_files()
    settings = files.pop("mysite/settings.py")
    for shown, here in SETTINGS_HERE.items():
        assert shown in settings, f"the quickstart's settings no longer have {shown}"
        settings = settings.replace(shown, here.format(dbname=dbname, redis=REDIS_URL))
    project.add_settings(settings)
    for path, code in files.items():
        project.write(path, code)
    return project


def run_quickstart(project: DjangoProject) -> tuple[dict[str, object], int]:
    """Run the section's commands in the project (the worker stopped by PID at the end)
    and send tasks; return what the sending script saw and the provider's maximum in
    flight."""
    worker: subprocess.Popen[bytes] | None = None
    with FakeProvider(latency_ms=100) as provider:
        env = {"PROVIDER_URL": provider.url}
        try:
            for command in sh_commands(quickstart=True):
                argv = shlex.split(command)
                if argv[:2] == ["python", "manage.py"]:
                    done = project.manage(*argv[2:], env=env)
                    assert done.returncode == 0, f"{command}:\n{done.stdout}\n{done.stderr}"
                elif argv[0] == "celery":
                    assert worker is None
                    worker = subprocess.Popen(
                        [str(Path(project.python).parent / "celery"), *argv[1:]],
                        cwd=project.root,
                        env={**project.environment(), **env},
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.PIPE,
                        start_new_session=True,
                    )
                else:
                    raise AssertionError(f"quickstart command the test cannot run: {command}")
            assert worker is not None, "the quickstart starts no worker"
            seen = project.script(SEND_TASKS, timeout=150, env=env)
        finally:
            if worker is not None:
                worker.send_signal(signal.SIGTERM)
                try:
                    worker.communicate(timeout=30)
                except subprocess.TimeoutExpired:
                    worker.kill()
                    worker.communicate(timeout=10)
        return seen, provider.stats().max_in_flight


@pytest.fixture
def quickstart_database() -> Iterator[str]:
    dsn = create_database("runcell_quickstart")
    try:
        yield dsn
    finally:
        drop_database(dsn)


def quickstart_limit() -> int:
    namespace: dict[str, object] = {}
    exec(quickstart_files()["mysite/settings.py"].replace("INSTALLED_APPS +=", "_ ="), namespace)
    runcell = namespace["RUNCELL"]
    assert isinstance(runcell, dict)
    return int(runcell["LIMITERS"]["openai"]["max_concurrent"])


def test_readme_quickstart_builds_a_project_whose_worker_keeps_the_limit(
    tmp_path: Path, quickstart_database: str
) -> None:
    dbname = psycopg_dbname(quickstart_database)
    project = build_quickstart(tmp_path / "site", dbname)
    seen, max_in_flight = run_quickstart(project)
    assert len(seen["replies"]) == 12  # type: ignore[arg-type]
    assert seen["admin"] == 200
    assert seen["openai_in_admin"]
    limit = quickstart_limit()
    assert 1 <= max_in_flight <= limit == 2  # four worker processes, two slots


@pytest.mark.stress
@pytest.mark.timeout(900)
def test_readme_quickstart_works_from_a_fresh_virtualenv_with_the_install_line(
    tmp_path: Path, quickstart_database: str
) -> None:
    """The install line as written, with the checkout for the package's name, in a new
    virtualenv: nothing of the development environment is used."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    (line,) = [c for c in sh_commands(quickstart=None) if INSTALL.search(c)]
    extras = INSTALL.search(line)
    assert extras is not None
    installed = subprocess.run(
        [
            str(venv / "bin/python"),
            "-m",
            "pip",
            "install",
            "--disable-pip-version-check",
            f"runcell-celery[{extras['extras']}] @ file://{ROOT}",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]
    project = build_quickstart(
        tmp_path / "site", psycopg_dbname(quickstart_database), python=str(venv / "bin/python")
    )
    seen, max_in_flight = run_quickstart(project)
    assert len(seen["replies"]) == 12  # type: ignore[arg-type]
    assert 1 <= max_in_flight <= quickstart_limit()


def psycopg_dbname(dsn: str) -> str:
    return str(psycopg.conninfo.conninfo_to_dict(dsn)["dbname"])


def test_readme_metrics_exporter_command_serves_until_stopped(block_env: dict[str, str]) -> None:
    (command,) = [c for c in sh_commands() if "runcell_celery.metrics" in c]
    argv = shlex.split(command)
    # Any free port here (the README's may be taken), on the README test's database.
    argv = [a for a in argv if a not in ("--port", "9464")] + ["--port", "0"]
    env = {**block_env, "RUNCELL_DATABASE_URL": block_env["DATABASE_URL"]}
    proc = subprocess.Popen(
        [str(ROOT / argv[0]), *argv[1:]],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        assert "listening on http://" in line, line
        url = line.split("listening on ", 1)[1].split()[0].replace("0.0.0.0", "127.0.0.1")
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(url, timeout=10) as response:
            assert b"runcell_database_up 1.0" in response.read()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=20)
    assert proc.returncode == 0
