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

from runcell_celery.metrics.exporter import main
from tests.support.celery_fixtures import ROOT

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
