"""Every code block in README.md and in the documentation (docs/*.md) runs, as a reader
would run it; the documentation builds, and lists every public name.

* ``python`` blocks: each in a fresh interpreter, with ``DATABASE_URL`` (a database of
  this test's own, with the limiter's schema), ``REDIS_URL`` and ``PROVIDER_URL`` (a
  fake provider) set. A block with ``urlpatterns`` must add to the project's
  (``urlpatterns += [...]``), not replace them and the admin with them. A block
  that sends a Celery task (``app`` and ``result``) gets a real worker for its app, and
  the result is awaited; a block that defines ``RUNCELL`` has it validated.
* ``sh`` blocks: each command line. ``./demo`` runs in its CI form (``--no-serve --size
  small``, on this test's database) and must show the limit held; the benchmarks run
  with small sizes; the fake provider and the metrics exporter are started, asked for
  their health and stopped; ``scripts/test`` is the command running this very test
  (``.ci/run`` calls it); the ``sphinx-build`` line builds the documentation.
* ``text`` blocks are sample output and are not run. MyST directives (``{include}``,
  ``{toctree}``, ``{eval-rst}``) are the build's, which the build test runs.
* The blocks of README's "Use it in your Django project" (the quickstart, which
  docs/getting-started.md includes) are files of a project, not scripts:
  ``test_readme_quickstart_builds_a_project_whose_worker_keeps_the_limit`` writes them
  into a project made by ``django-admin startproject`` (the first line of each names
  its file) and runs the section's commands in it; the ``pip install`` line's extras
  must exist, and the stress suite runs it in a fresh virtualenv.
* The build: ``sphinx-build -W`` as docs/development.md shows it (and scripts/test runs
  it), into a directory of this test's own; its ``objects.inv`` must name every name the
  public modules export (their ``__all__``).

A block in another language, or a command the test does not know, fails it, so a new
block needs a way to run.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import queue
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import tomllib
import urllib.request
import uuid
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest

from runcell_celery.postgres import ensure_schema
from runcell_celery.testing import FakeProvider
from tests.support.demo import demo_environment, run_demo, summary
from tests.support.django_project import DjangoProject
from tests.support.pg import ADMIN_DSN, create_database, drop_database

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
#: The pages whose blocks run: the README, then the documentation's.
PAGES = [README, *sorted(DOCS.glob("*.md"))]
#: A fence's opening line: its backticks and its info string (a language, or a MyST
#: directive such as ``{include} ../README.md``).
OPENING = re.compile(r"^(?P<fence>`{3,})(?P<info>[^`]*)$")
#: The fenced blocks that are MyST directives, which the build runs (not this test).
DIRECTIVES = {"{include}", "{toctree}", "{eval-rst}"}
#: A Redis database of the docs test's own: its Celery block uses the default queue.
REDIS_URL = os.environ.get("RUNCELL_TEST_README_REDIS", "redis://127.0.0.1:6379/15")

DRIVER = """
import sys
namespace = {"__name__": "readme"}
source = sys.stdin.read()
project_urls = [object()]  # a block adding to a project's urlpatterns keeps what it had
if "urlpatterns += " in source:
    namespace["urlpatterns"] = list(project_urls)
exec(compile(source, sys.argv[1], "exec"), namespace)
if "urlpatterns" in namespace:
    kept = namespace["urlpatterns"][: len(project_urls)] == project_urls
    assert kept, "the block replaces the project's urlpatterns (and the admin with them)"
    assert len(namespace["urlpatterns"]) > len(project_urls), "the block adds no URL"
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
    "bench/gevent_pool.py": [
        "--tasks",
        "40",
        "--concurrency",
        "20",
        "--limit",
        "4",
        "--hold-ms",
        "20",
        "--arms",
        "wait,defer,no_celery",
    ],
}


#: The README section whose blocks are a Django project's files and commands.
QUICKSTART = "## Use it in your Django project\n"


def _quickstart_span(text: str) -> tuple[int, int]:
    start = text.index(QUICKSTART)
    return start, text.index("\n## ", start + len(QUICKSTART))


@dataclass(frozen=True)
class Block:
    """One fenced block of a page: where it starts, its info string and its code."""

    page: Path
    line: int  # of the opening fence, from 1
    offset: int  # of the opening fence in the page's text
    info: str
    code: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def page_blocks(page: Path) -> list[Block]:
    """Every fenced block of ``page``, in order. A fence closes on a line of as many
    backticks (or more) and nothing else, as in CommonMark, so a directive's closing
    fence is never taken for the opening of a block."""
    text = page.read_text()
    blocks: list[Block] = []
    lines = text.splitlines(keepends=True)
    offset, i = 0, 0
    offsets = []
    for raw in lines:
        offsets.append(offset)
        offset += len(raw)
    while i < len(lines):
        opening = OPENING.match(lines[i].rstrip("\n"))
        if opening is None:
            i += 1
            continue
        fence = opening["fence"]
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not re.fullmatch(f"{fence}`*\\s*", lines[j].rstrip("\n")):
            body.append(lines[j])
            j += 1
        assert j < len(lines), f"{page.relative_to(ROOT)}:{i + 1}: a fence never closed"
        blocks.append(Block(page, i + 1, offsets[i], opening["info"].strip(), "".join(body)))
        i = j + 1
    return blocks


def all_blocks() -> list[Block]:
    return [block for page in PAGES for block in page_blocks(page)]


def in_quickstart(block: Block) -> bool:
    if block.page != README:
        return False
    start, end = _quickstart_span(README.read_text())
    return start < block.offset < end


def doc_blocks(language: str, *, quickstart: bool | None = False) -> list[Block]:
    """The fenced blocks in ``language`` of the README and the docs' pages: those outside
    the README's quickstart section (``quickstart=False``), inside it (``True``), or all
    (``None``)."""
    return [
        block
        for block in all_blocks()
        if block.info == language and (quickstart is None or in_quickstart(block) == quickstart)
    ]


def readme_blocks(language: str, *, quickstart: bool | None = False) -> list[tuple[int, str]]:
    """``(line number, code)`` of each block of README.md in ``language`` (see
    :func:`doc_blocks` for ``quickstart``)."""
    return [
        (block.line, block.code)
        for block in doc_blocks(language, quickstart=quickstart)
        if block.page == README
    ]


def test_docs_have_only_blocks_this_test_can_run() -> None:
    infos = {block.info.split()[0] if block.info else "" for block in all_blocks()}
    assert infos <= {"python", "sh", "text"} | DIRECTIVES, infos
    assert doc_blocks("python")
    assert doc_blocks("sh")
    for line, code in readme_blocks("python", quickstart=True):
        assert FILE_LINE.match(code), f"quickstart block at line {line} names no file"


def test_every_page_is_read_by_this_test() -> None:
    """A page under docs/ in another format would escape the block tests."""
    sources = {p.name for p in DOCS.iterdir() if p.is_file()} - {"conf.py"}
    assert sources == {p.name for p in PAGES if p.parent == DOCS}, sources


@pytest.fixture(scope="module")
def block_env() -> Iterator[dict[str, str]]:
    """The environment of every block: a database of this module's own with the
    limiter's schema, as in a migrated project (so a block that only reads, such as the
    counters', runs in any order and on any xdist worker), Redis and a fake provider."""
    database = create_database("runcell_docs")
    with psycopg.connect(database, autocommit=True) as conn:
        ensure_schema(conn)
    with FakeProvider(latency_ms=5) as provider:
        yield {
            **os.environ,
            "DATABASE_URL": database,
            "REDIS_URL": REDIS_URL,
            "PROVIDER_URL": provider.url,
            "PYTHONPATH": str(ROOT),
        }
    drop_database(database)


@pytest.mark.parametrize("block", doc_blocks("python"), ids=lambda block: block.where)
def test_docs_python_block_runs(block: Block, block_env: dict[str, str]) -> None:
    code = block.code
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, str(block.page.relative_to(ROOT))],
        input=code.encode(),
        env=block_env,
        cwd=ROOT,
        capture_output=True,
        timeout=120,
        check=False,
    )
    output = (done.stdout + done.stderr).decode(errors="replace")
    assert done.returncode == 0, f"the block at {block.where} failed:\n{code}\n{output}"
    if "apply_async" in code:
        assert "celery result:" in output  # a worker ran the task the block sent
    if "RUNCELL = " in code and "ConcurrencyConfigError" not in code:
        assert "RUNCELL is valid" in output


def test_docs_runcell_block_is_the_example_projects_setting() -> None:
    (block,) = [b.code for b in doc_blocks("python") if '"provider"' in b.code]
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
    """The command lines of the README's and the docs' ``sh`` blocks (see
    :func:`doc_blocks` for ``quickstart``)."""
    commands = []
    for block in doc_blocks("sh", quickstart=quickstart):
        for raw in block.code.splitlines():
            line = raw.split(" #", 1)[0].strip()
            if line and not line.startswith("#"):
                commands.append(line)
    return commands


def test_docs_commands_are_all_known() -> None:
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
            # Run by the build tests below (into a directory of their own).
            or command == DOCS_BUILD
        )
        assert known, f"a command in the docs with no way to run it here: {command}"


def test_docs_test_command_is_what_ci_runs() -> None:
    assert "scripts/test" in sh_commands()
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert any("scripts/test" in line and not line.lstrip().startswith("#") for line in ci)


def test_docs_nox_sessions_are_defined_and_run_by_ci() -> None:
    """Each session takes minutes, so this test does not run them: it checks that the
    docs' ``nox -s`` lines name sessions noxfile.py defines and scripts/test runs."""
    shown = {shlex.split(c)[2] for c in sh_commands() if c.startswith(".venv/bin/nox -s ")}
    assert shown, "the docs show how to run the nox sessions"
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
def test_docs_demo_command_runs_and_the_limit_holds() -> None:
    variants = {tuple(shlex.split(c)[1:]) for c in sh_commands() if c.startswith("./demo")}
    assert () in variants, "the docs show ./demo itself"
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
SLOW_BENCHES = {"bench/celery_overhead.py", "bench/gevent_pool.py", "bench/postgres_engine.py"}


@pytest.mark.parametrize(
    "script",
    [
        pytest.param(script, marks=[pytest.mark.stress] if script in SLOW_BENCHES else [])
        for script in sorted(BENCH_ARGS)
    ],
)
def test_docs_benchmark_runs(script: str) -> None:
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


def test_docs_fake_provider_command_serves_until_stopped() -> None:
    # The quickstart's, in the background, is run by the quickstart's test.
    (command,) = [
        c for c in sh_commands(quickstart=False) if "runcell_celery.testing.fake_provider" in c
    ]
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
#: The install line (a package name and its extras), once the package is published.
INSTALL = re.compile(r'pip install "runcell-celery\[(?P<extras>[\w,]+)\]"')
#: The install line from a clone, which the quickstart runs until then.
INSTALL_FROM_CLONE = re.compile(
    r'pip install "runcell-celery\[(?P<extras>[\w,]+)\] @ file://\$RUNCELL_SRC"'
)
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
import runcell_celery, runcell_django
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
                              "openai_in_admin": "openai" in page.content.decode(),
                              "packages": [runcell_celery.__file__, runcell_django.__file__]}))
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


#: The quickstart's placeholders the test replaces: the provider's port and the clone.
PROVIDER_PORT = "8900"
CLONE_LINE = re.compile(r"^RUNCELL_SRC=\S+$")
#: The lines that make and fill the virtualenv: the default run uses the checkout's.
VENV_LINES = ("python3 -m venv .venv", ". .venv/bin/activate")


class Shell:
    """One bash session, as the reader's terminal: commands run in it one after another
    (``cd``, ``export`` and ``. activate`` last), each waited for; ``cmd &`` leaves a
    process running, whose id is kept."""

    def __init__(self, cwd: Path, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            ["bash", "--noprofile", "--norc"],
            cwd=cwd,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.background: list[int] = []
        threading.Thread(target=self._read, name="readme-shell-reader", daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def run(self, command: str, timeout: float = 300) -> tuple[int, str]:
        """Run ``command`` (stdin from /dev/null); return its status and what the shell
        printed meanwhile (background processes included)."""
        marker = f"readme-done-{uuid.uuid4().hex}"
        assert self.proc.stdin is not None
        script = f'{{ {command}\n}} </dev/null\necho {marker} $? "$!"\n'
        self.proc.stdin.write(script)
        self.proc.stdin.flush()
        seen: list[str] = []
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(
                    f"{command!r} still runs after {timeout} s:\n" + "".join(seen)
                ) from None
            if line is None:
                raise AssertionError(f"the shell ended during {command!r}:\n" + "".join(seen))
            if marker in line:  # after output that did not end its line (curl's)
                before, after = line.split(marker, 1)
                seen.append(before)
                status, last = after.split(" ", 2)[1:]
                if command.endswith("&") and last.strip():
                    self.background.append(int(last))
                return int(status), "".join(seen)
            seen.append(line)

    def pwd(self) -> Path:
        code, output = self.run("pwd")
        assert code == 0, output
        return Path(output.splitlines()[-1])

    def close(self) -> None:
        """Stop the background processes (SIGTERM by id, the worker warm), then the shell."""
        for pid in reversed(self.background):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        for pid in self.background:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and _alive(pid):
                time.sleep(0.1)
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever of the session is left


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z")


def quickstart_blocks() -> list[tuple[str, str]]:
    """The quickstart's blocks in the order a reader meets them: ``("sh", code)`` and
    ``("python", code)``."""
    return [
        (block.info, block.code)
        for block in page_blocks(README)
        if in_quickstart(block) and block.info in ("sh", "python")
    ]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_quickstart(
    tmp_path: Path,
    dbname: str,
    *,
    fresh_virtualenv: bool = False,
    wheel: Path | None = None,
    redis: str = REDIS_URL,
) -> tuple[dict[str, object], int, str]:
    """Follow the quickstart in one shell from the empty directory ``tmp_path``: its
    commands in order, each file written when its block comes. Replaced: the database's
    name and the Redis database (this test's own), the provider's port (a free one),
    the worker run in the background; without ``fresh_virtualenv`` the checkout's
    virtualenv (and code) instead of the virtualenv and ``pip install`` lines. With a
    built ``wheel`` (a fresh virtualenv), the install line installs that wheel, with the
    line's extras, instead of the clone, and the clone's line is left out. ``redis``:
    the broker's Redis database (a test run beside this module's needs its own, the
    project's worker taking tasks from the default queue).

    Return what :data:`SEND_TASKS` saw, the provider's maximum in flight, and what the
    shell printed.
    """
    fresh_virtualenv = fresh_virtualenv or wheel is not None
    port = str(_free_port())
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("DJANGO_SETTINGS_MODULE", "VIRTUAL_ENV", "PYTHONPATH")
        and not key.startswith("RUNCELL_DEMO_")
    }
    if not fresh_virtualenv:
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "django_app")])
    shell = Shell(tmp_path, env)
    printed: list[str] = []
    try:
        worker_started = False
        for language, code in quickstart_blocks():
            if language == "python":
                named = FILE_LINE.match(code)
                assert named, code
                path = shell.pwd() / named["path"]
                if named["path"] == "mysite/settings.py":
                    for shown, here in SETTINGS_HERE.items():
                        assert shown in code, f"the quickstart's settings no longer have {shown}"
                        code = code.replace(shown, here.format(dbname=dbname, redis=redis))
                    with path.open("a") as file:  # "added to the end"
                        file.write("\n" + code)
                else:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_text(code)
                continue
            for raw in code.splitlines():
                command = raw.split(" #", 1)[0].strip()
                if not command or command.startswith("#"):
                    continue
                if not fresh_virtualenv and (
                    command in VENV_LINES or INSTALL_FROM_CLONE.fullmatch(command)
                ):
                    continue  # the checkout's virtualenv is on PATH already
                if wheel is not None and CLONE_LINE.match(command):
                    continue  # nothing of the checkout is used
                if wheel is not None and (install := INSTALL_FROM_CLONE.fullmatch(command)):
                    requirement = f"runcell-celery[{install['extras']}] @ {wheel.as_uri()}"
                    command = f"pip install {shlex.quote(requirement)}"
                elif CLONE_LINE.match(command):
                    command = f"RUNCELL_SRC={shlex.quote(str(ROOT))}"
                elif command.startswith("createdb "):
                    argv = shlex.split(command)
                    assert argv[-1] == "mysite", command
                    command = shlex.join([*argv[:-1], dbname])
                command = command.replace(PROVIDER_PORT, port)
                if command.startswith("celery "):
                    assert not worker_started, "the quickstart starts a second worker"
                    command += " &"  # the reader's first terminal
                    worker_started = True
                print(f"$ {command}", file=sys.stderr, flush=True)  # shown if it hangs
                code_, output = shell.run(command, timeout=600 if fresh_virtualenv else 180)
                print(output, file=sys.stderr, flush=True)
                printed.append(f"$ {command}\n{output}")
                assert code_ == 0, "".join(printed)
        assert worker_started, "the quickstart starts no worker"
        project = DjangoProject(shell.pwd(), name="mysite", python=_python(shell))
        seen = project.script(
            SEND_TASKS,
            timeout=150,
            env={**env, "PROVIDER_URL": f"http://127.0.0.1:{port}"},
        )
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with opener.open(f"http://127.0.0.1:{port}/stats", timeout=10) as response:
            max_in_flight = int(json.loads(response.read())["max_in_flight"])
    finally:
        shell.close()
    return seen, max_in_flight, "".join(printed)


def _python(shell: Shell) -> str:
    """The ``python`` the reader's shell runs (the virtualenv's)."""
    code, output = shell.run("command -v python")
    assert code == 0, output
    return output.splitlines()[-1]


@pytest.fixture
def quickstart_database() -> Iterator[str]:
    """The name the quickstart's ``createdb`` uses here; the database is dropped after."""
    name = f"runcell_quickstart_{uuid.uuid4().hex[:10]}"
    try:
        yield name
    finally:
        drop_database(psycopg.conninfo.make_conninfo(ADMIN_DSN, dbname=name))


def quickstart_limit() -> int:
    namespace: dict[str, object] = {}
    exec(quickstart_files()["mysite/settings.py"].replace("INSTALLED_APPS +=", "_ ="), namespace)
    runcell = namespace["RUNCELL"]
    assert isinstance(runcell, dict)
    return int(runcell["LIMITERS"]["openai"]["max_concurrent"])


def check_quickstart_run(seen: dict[str, object], max_in_flight: int, printed: str) -> None:
    assert len(seen["replies"]) == 12  # type: ignore[arg-type]
    assert seen["admin"] == 200
    assert seen["openai_in_admin"]
    assert 1 <= max_in_flight <= quickstart_limit() == 2, printed  # four processes, two slots
    # The README's own send line printed its replies, and its look at the provider's count.
    assert "['fake reply to: Summarize: doc 0'" in printed, printed
    assert re.search(r'"max_in_flight": [12]\b', printed), printed


def test_readme_quickstart_builds_a_project_whose_worker_keeps_the_limit(
    tmp_path: Path, quickstart_database: str
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    check_quickstart_run(*run_quickstart(empty, quickstart_database))


@pytest.mark.stress
@pytest.mark.timeout(900)
def test_readme_quickstart_works_from_a_fresh_virtualenv_with_the_install_line(
    tmp_path: Path, quickstart_database: str
) -> None:
    """The virtualenv and install lines as written, the clone being this checkout:
    nothing of the development environment is used. The install section's line for a
    clone is the same line."""
    (line,) = [c for c in sh_commands(quickstart=True) if INSTALL_FROM_CLONE.fullmatch(c)]
    assert line in sh_commands(quickstart=False), "Install shows the quickstart's line"
    extras = INSTALL_FROM_CLONE.fullmatch(line)
    assert extras is not None
    assert extras["extras"] == "celery,django"
    empty = tmp_path / "empty"
    empty.mkdir()
    check_quickstart_run(*run_quickstart(empty, quickstart_database, fresh_virtualenv=True))


def psycopg_dbname(dsn: str) -> str:
    return str(psycopg.conninfo.conninfo_to_dict(dsn)["dbname"])


def test_docs_metrics_exporter_command_serves_until_stopped(block_env: dict[str, str]) -> None:
    (command,) = [c for c in sh_commands() if "runcell_celery.metrics" in c]
    argv = shlex.split(command)
    # Any free port here (the docs' may be taken), on this test's database.
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


# -- The build, the API reference, the README's length, the changelog ------------------

#: The build line of docs/development.md, which scripts/test runs too.
DOCS_BUILD = ".venv/bin/sphinx-build -W --keep-going -b html docs docs/_build/html"
#: The modules whose every exported name (``__all__``) the API reference must list: the
#: five the issue names, and the others docs/api.md documents.
PUBLIC_MODULES = {
    "runcell_celery": "runcell_celery/__init__.py",
    "runcell_celery.celery": "runcell_celery/celery/__init__.py",
    "runcell_celery.postgres": "runcell_celery/postgres/__init__.py",
    "runcell_celery.testing": "runcell_celery/testing/__init__.py",
    "runcell_django": "django_app/runcell_django/__init__.py",
    "runcell_django.routers": "django_app/runcell_django/routers.py",
    "runcell_django.metrics": "django_app/runcell_django/metrics.py",
    "runcell_celery.registry": "runcell_celery/registry.py",
    "runcell_celery.metrics": "runcell_celery/metrics/__init__.py",
    "runcell_celery.conformance": "runcell_celery/conformance/__init__.py",
}
#: A line of an ``objects.inv`` (after its header): name, domain:role, priority, uri,
#: display name.
INVENTORY_LINE = re.compile(r"^(?P<name>\S+)\s+(?P<domain>\w+):(?P<role>[\w-]+)\s+-?\d+\s")


def exported_names(module: str) -> list[str]:
    """The module's ``__all__``, read from its source (without importing it)."""
    tree = ast.parse((ROOT / PUBLIC_MODULES[module]).read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            names = ast.literal_eval(node.value)
            assert isinstance(names, list | tuple), module
            return [str(name) for name in names]
    raise AssertionError(f"{module} has no __all__")


def inventory_objects(path: Path) -> set[str]:
    """The Python objects an ``objects.inv`` (Sphinx's inventory, version 2) names."""
    raw = path.read_bytes()
    header, _, body = raw.partition(b"# The remainder of this file is compressed using zlib.\n")
    assert header.startswith(b"# Sphinx inventory version 2\n"), header[:80]
    names = set()
    for line in zlib.decompress(body).decode().splitlines():
        entry = INVENTORY_LINE.match(line)
        if entry is not None and entry["domain"] == "py":
            names.add(entry["name"])
    return names


def unlisted(documented: set[str]) -> list[str]:
    """The exported names of :data:`PUBLIC_MODULES` that ``documented`` lacks."""
    return [
        f"{module}.{name}"
        for module in PUBLIC_MODULES
        for name in exported_names(module)
        if f"{module}.{name}" not in documented
    ]


@pytest.fixture(scope="module")
def built_docs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site as :data:`DOCS_BUILD` builds it, into a directory of this test's own
    (the doctrees too), so a stale docs/_build proves nothing."""
    out = tmp_path_factory.mktemp("docs") / "html"
    argv = shlex.split(DOCS_BUILD)
    assert argv[-2:] == ["docs", "docs/_build/html"], argv
    done = subprocess.run(
        [str(ROOT / argv[0]), *argv[1:-1], str(out)],
        cwd=ROOT,
        capture_output=True,
        timeout=300,
        check=False,
    )
    output = (done.stdout + done.stderr).decode(errors="replace")
    assert done.returncode == 0, f"the documentation does not build:\n{output}"
    return out


def test_docs_build_line_is_shown_and_what_scripts_test_runs() -> None:
    assert DOCS_BUILD in sh_commands(), "docs/development.md shows the build line"
    script = (ROOT / "scripts" / "test").read_text().splitlines()
    runs = [
        line.strip().replace('"$VENV/bin/sphinx-build"', ".venv/bin/sphinx-build", 1)
        for line in script
        if line.lstrip().startswith('"$VENV/bin/sphinx-build"')
    ]
    assert runs == [DOCS_BUILD], runs


def test_docs_build_with_warnings_as_errors(built_docs: Path) -> None:
    assert (built_docs / "index.html").is_file()
    for page in PAGES[1:]:
        assert (built_docs / page.with_suffix(".html").name).is_file(), page.name


def test_api_reference_lists_every_exported_name(built_docs: Path) -> None:
    documented = inventory_objects(built_docs / "objects.inv")
    assert unlisted(documented) == []
    # The check sees what it checks: drop one exported name of each module from what
    # was built, and it is reported.
    for module in PUBLIC_MODULES:
        name = f"{module}.{exported_names(module)[0]}"
        assert unlisted(documented - {name}) == [name]


def test_readme_fits_on_three_screens() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines: move detail into docs/"


def test_changelog_has_an_unreleased_section_and_the_docs_include_it() -> None:
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert changelog.startswith("# Changelog\n")
    assert "\n## Unreleased\n" in changelog
    included = [
        block.info
        for block in page_blocks(DOCS / "changelog.md")
        if block.info.startswith("{include}")
    ]
    assert included == ["{include} ../CHANGELOG.md"]


#: A Markdown link to a file of this repository: ``[text](docs/page.md#anchor)``.
LOCAL_LINK = re.compile(r"\]\((?P<path>(?!https?:|#)[^)#\s]+)(?:#(?P<anchor>[^)\s]+))?\)")


def test_readme_links_reach_pages_and_sections_that_exist(built_docs: Path) -> None:
    """The README is built only in part (the sections docs/getting-started.md includes):
    its other links are checked here, against the files and the built pages' ids."""
    links = LOCAL_LINK.findall(README.read_text())
    assert any(path.startswith("docs/") for path, _ in links)
    for path, anchor in links:
        assert (ROOT / path).is_file(), f"README.md links to a missing file: {path}"
        if not anchor:
            continue
        assert path.startswith("docs/"), (path, anchor)
        assert path.endswith(".md"), (path, anchor)
        page = (built_docs / Path(path).relative_to("docs").with_suffix(".html")).read_text()
        assert f'id="{anchor}"' in page, f"README.md links to a missing section: {path}#{anchor}"
