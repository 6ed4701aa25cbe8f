"""A real Prometheus for tests, on a free port of 127.0.0.1, with a temp config and TSDB.

It scrapes the targets it is given (``host:port`` of ``/metrics`` servers, one job ``tandem``)
every ``scrape_interval_s``. ``query()`` and ``wait_for()`` read it synchronously, for fixtures
that wait until it has seen what they expect; ``pause()`` and ``resume()`` (SIGSTOP/SIGCONT)
make a server that accepts connections but never answers.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.server_process import ServerProcess, free_port

START_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 10.0
JOB = "tandem"


class PrometheusServer(ServerProcess):
    """One ``prometheus`` process scraping ``targets``."""

    def __init__(
        self,
        executable: str,
        port: int,
        workdir: Path,
        targets: Sequence[str],
        scrape_interval_s: float,
        flags: Sequence[str] = (),
    ) -> None:
        """``flags``: more command-line flags (``--enable-feature=exemplar-storage``)."""
        super().__init__(f"prometheus on port {port}", START_TIMEOUT_S, STOP_TIMEOUT_S)
        self._executable = executable
        self.port = port
        self._workdir = workdir
        self._targets = list(targets)
        self.scrape_interval_s = scrape_interval_s
        self._flags = list(flags)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Write the config, launch the server and return once ``/-/ready`` answers 200."""
        interval = f"{round(self.scrape_interval_s * 1000)}ms"
        config = {  # JSON is YAML
            "global": {"scrape_interval": interval, "evaluation_interval": interval},
            "scrape_configs": [{"job_name": JOB, "static_configs": [{"targets": self._targets}]}],
        }
        config_file = self._workdir / "prometheus.yml"
        config_file.write_text(json.dumps(config))
        self.launch(
            [
                self._executable,
                f"--config.file={config_file}",
                f"--storage.tsdb.path={self._workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
                *self._flags,
            ],
            self._workdir / "prometheus.log",
            self._ready,
        )

    def query(self, promql: str) -> list[dict[str, Any]]:
        """An instant query's result (the elements of its vector), now."""
        url = f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
        with urllib.request.urlopen(url, timeout=5) as response:
            body = json.load(response)
        if body.get("status") != "success":
            raise RuntimeError(f"query {promql!r} failed: {body}")
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def query_exemplars(self, promql: str, start: float, end: float) -> list[dict[str, Any]]:
        """The exemplars of the series ``promql`` selects between ``start`` and ``end`` (unix
        seconds): one entry per series, with its ``exemplars``."""
        params = urllib.parse.urlencode({"query": promql, "start": start, "end": end})
        with urllib.request.urlopen(f"{self.url}/api/v1/query_exemplars?{params}") as response:
            body = json.load(response)
        if body.get("status") != "success":
            raise RuntimeError(f"exemplar query {promql!r} failed: {body}")
        result: list[dict[str, Any]] = body["data"]
        return result

    def wait_for(
        self,
        promql: str,
        done: Callable[[list[dict[str, Any]]], bool],
        timeout_s: float = 30.0,
    ) -> None:
        """Poll ``promql`` until ``done(result)``; ``TimeoutError`` with the last result."""
        deadline = time.monotonic() + timeout_s
        while True:
            result = self.query(promql)
            if done(result):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{promql!r} still {result} after {timeout_s:g} s")
            time.sleep(self.scrape_interval_s / 4)

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=0.5) as response:
                return bool(response.status == 200)
        except (OSError, urllib.error.URLError):
            return False


@contextmanager
def running_prometheus(
    targets: Sequence[str], scrape_interval_s: float = 1.0, flags: Sequence[str] = ()
) -> Iterator[PrometheusServer]:
    """A started server on a free port scraping ``targets``, stopped and cleaned up on exit.

    Fails the test (never skips it) when ``prometheus`` is not installed.
    """
    executable = shutil.which("prometheus")
    if executable is None:
        pytest.fail(
            "prometheus is not on PATH: run scripts/install --dev (Debian's prometheus "
            "package); the Prometheus provider's tests run against a real server and are "
            "never skipped",
            pytrace=False,
        )
    with tempfile.TemporaryDirectory(prefix="tandem-prometheus-") as workdir:
        server = PrometheusServer(
            executable, free_port(), Path(workdir), targets, scrape_interval_s, flags
        )
        server.start()
        try:
            yield server
        finally:
            server.stop()
