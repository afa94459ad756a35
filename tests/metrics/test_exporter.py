"""The standalone exporter, ``python -m runcell_celery.metrics``, as a subprocess.

Each test starts it on a free port (``--port 0``: the printed address says which),
scrapes it over HTTP, and stops it by PID with SIGTERM. Arguments it refuses are
tried on its ``main`` in this process (it exits before serving).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from prometheus_client.mmap_dict import MmapedDict, mmap_key

from runcell_celery.metrics.exporter import main
from tests.support.celery_fixtures import ROOT
from tests.support.secrets import unique_secret

from .conftest import TOKEN, Scrape

Started = Callable[..., str]


@pytest.fixture
def exporter() -> Iterator[Started]:
    """``exporter(*args, token=None)``: start one; return its URL."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(*args: str, token: str | None = None) -> str:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        env.pop("RUNCELL_DATABASE_URL", None)
        env.pop("PROMETHEUS_MULTIPROC_DIR", None)
        if token is not None:
            env["RUNCELL_METRICS_TOKEN"] = token
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "runcell_celery.metrics",
                "--port=0",
                "--address=127.0.0.1",
                *args,
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        procs.append(proc)
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()
        assert "listening on http://127.0.0.1:" in line, line
        return line.split("listening on ", 1)[1].split()[0]

    yield start
    for proc in procs:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
        proc.wait(15)
        assert proc.returncode == 0, "the exporter stops cleanly on SIGTERM"


def get(url: str, **headers: str) -> tuple[int, str, dict[str, str]]:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(urllib.request.Request(url, headers=headers), timeout=10) as response:
            return response.status, response.read().decode(), dict(response.headers)
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(), dict(error.headers)


def test_the_exporter_serves_the_gauges_of_every_stored_limiter(
    exporter: Started, make_limiter: Callable[..., object], pg_dsn: str
) -> None:
    llm = make_limiter(max_concurrent=3)
    url = exporter(f"--database={pg_dsn}")
    status, text, headers = get(url)
    assert status == 200
    assert headers["Content-Type"].startswith("text/plain")
    got = Scrape(text)
    assert got.values("runcell_limit", limiter=llm.name) == [3]  # type: ignore[attr-defined]
    assert got.values("runcell_database_up") == [1]


def test_with_a_token_set_a_scrape_without_it_is_refused(exporter: Started, tmp_path: Path) -> None:
    url = exporter(f"--multiprocess-dir={tmp_path}", token=TOKEN)
    assert get(url)[0] == 401
    assert get(url, Authorization="Bearer wrong-token-0123456789")[0] == 401
    status, _, _ = get(url, Authorization=f"Bearer {TOKEN}")
    assert status == 200
    assert get(url.replace("/metrics", "/other"))[0] == 404


def test_an_unreachable_database_still_serves_and_says_it_is_down(exporter: Started) -> None:
    url = exporter("--database=postgresql://postgres@127.0.0.1:1/postgres")
    status, text, _ = get(url)
    assert status == 200
    assert Scrape(text).values("runcell_database_up") == [0]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--port=70000"], "argument --port: '70000' is invalid: must be a port, 0 to 65535"),
        (["--port=9464"], "nothing to export: give --database (or set RUNCELL_DATABASE_URL)"),
        (
            ["--port=9464", "--multiprocess-dir=/nonexistent/runcell"],
            "the multiprocess directory = '/nonexistent/runcell' is invalid: no such directory",
        ),
        (
            ["--port=9464", "--database=dbname=x", "--cache-ms=-5"],
            "argument --cache-ms: '-5' is invalid: must be 0 to 2147483647 milliseconds",
        ),
    ],
)
def test_bad_arguments_are_refused_naming_the_value(
    args: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("RUNCELL_DATABASE_URL", raising=False)
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    with pytest.raises(SystemExit) as exited:
        main(args)  # refused before it serves anything
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def run_exporter(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run the exporter to its end (it refuses its arguments before serving)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("RUNCELL_", "PROMETHEUS_"))}
    return subprocess.run(
        [sys.executable, "-m", "runcell_celery.metrics", *args],
        cwd=ROOT,
        env={**clean, "PYTHONPATH": str(ROOT), **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize(
    ("address", "message"),
    [
        ("999.1.1.1", "argument --address: '999.1.1.1' is invalid: must be an IP address"),
        ("no such host!", "argument --address: 'no such host!' is invalid"),
        ("10.255.255.1", "argument --address/--port: cannot listen on '10.255.255.1' port 0"),
    ],
)
def test_a_bad_address_is_a_one_line_usage_error(
    address: str, message: str, tmp_path: Path
) -> None:
    done = run_exporter("--port=0", f"--address={address}", f"--multiprocess-dir={tmp_path}")
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert done.stderr.splitlines()[-1].startswith("python -m runcell_celery.metrics: error: ")
    assert message in done.stderr


@pytest.mark.parametrize(
    ("token", "message"),
    [
        ("x", "1 characters (surrounding whitespace dropped) is too short to be secret"),
        ("short-token\n", "11 characters (surrounding whitespace dropped) is too short"),
        ("a token with spaces in it", "it holds spaces, control or non-ASCII characters"),
    ],
)
def test_a_token_the_view_would_refuse_is_refused_by_the_exporter_unseen(
    token: str, message: str, tmp_path: Path
) -> None:
    done = run_exporter(
        "--port=0", f"--multiprocess-dir={tmp_path}", env={"RUNCELL_METRICS_TOKEN": token}
    )
    assert done.returncode == 2
    assert f"$RUNCELL_METRICS_TOKEN holds no valid token: {message}" in done.stderr
    if len(token.strip()) > 1:
        assert token.strip() not in done.stdout + done.stderr


def test_a_token_file_with_its_trailing_newline_serves_its_bearer(
    exporter: Started, tmp_path: Path
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(f"{TOKEN}\n")
    url = exporter(f"--multiprocess-dir={tmp_path}", f"--token-file={token_file}")
    assert get(url, Authorization=f"Bearer {TOKEN}")[0] == 200
    assert get(url)[0] == 401


def test_a_token_file_that_cannot_be_read_or_is_short_is_refused_unseen(tmp_path: Path) -> None:
    missing = run_exporter(
        "--port=0", f"--multiprocess-dir={tmp_path}", "--token-file=/nonexistent"
    )
    assert missing.returncode == 2
    assert "argument --token-file: '/nonexistent' cannot be read" in missing.stderr
    short = tmp_path / "short"
    short.write_text("tiny-secret\n")
    refused = run_exporter("--port=0", f"--multiprocess-dir={tmp_path}", f"--token-file={short}")
    assert refused.returncode == 2
    assert "holds no valid token: 11 characters" in refused.stderr
    assert "tiny-secret" not in refused.stderr
    both = run_exporter(
        "--port=0",
        f"--multiprocess-dir={tmp_path}",
        f"--token-file={short}",
        env={"RUNCELL_METRICS_TOKEN": TOKEN},
    )
    assert "give it or set $RUNCELL_METRICS_TOKEN, not both" in both.stderr


@pytest.mark.parametrize(
    "dsn",
    [
        "postgresql://app:{s}@[db/app",
        "host=db password={s} junk",
    ],
)
def test_a_malformed_database_is_refused_with_its_password_masked(dsn: str) -> None:
    secret = unique_secret()
    for given in ([f"--database={dsn.format(s=secret)}"], []):
        env = {} if given else {"RUNCELL_DATABASE_URL": dsn.format(s=secret)}
        done = run_exporter("--port=0", *given, env=env)
        assert done.returncode == 2
        assert "is invalid: not a PostgreSQL DSN" in done.stderr
        assert "***" in done.stderr
        assert secret not in done.stdout + done.stderr


def test_a_dsn_split_by_the_shell_is_refused_without_its_password() -> None:
    secret = unique_secret()
    done = run_exporter("--port=0", "--database", "host=db", f"password={secret}")
    assert done.returncode == 2
    assert "unrecognized arguments: password=***" in done.stderr
    assert secret not in done.stderr


def test_an_unreachable_database_with_a_password_never_shows_it(exporter: Started) -> None:
    secret = unique_secret()
    url = exporter(f"--database=postgresql://postgres:{secret}@127.0.0.1:1/postgres")
    status, text, _ = get(url)
    assert status == 200
    assert secret not in text
    assert Scrape(text).values("runcell_database_up") == [0]


def test_help_says_the_exporter_listens_on_every_interface_by_default() -> None:
    done = run_exporter("--help")
    assert done.returncode == 0
    text = " ".join(done.stdout.split())
    assert "default 0.0.0.0: every interface of the host" in text
    assert "trailing newline, is dropped" in text


def test_a_process_file_still_empty_does_not_fail_the_scrape_of_the_others(
    exporter: Started, tmp_path: Path
) -> None:
    # A prefork child creates its file before sizing it; one killed in that moment
    # leaves it empty for good (prometheus/client_python#1199).
    name = "runcell_slots_acquired"
    written = MmapedDict(str(tmp_path / "counter_101.db"))
    written.write_value(mmap_key(name, f"{name}_total", ["limiter"], ["llm"], "h"), 5.0, 0.0)
    written.close()
    (tmp_path / "counter_102.db").touch()
    url = exporter(f"--multiprocess-dir={tmp_path}")
    status, text, _ = get(url)
    assert status == 200, text
    assert Scrape(text).values(f"{name}_total", limiter="llm") == [5]
