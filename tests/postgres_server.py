"""A real PostgreSQL server for tests: a fresh cluster in a temp dir, on a free port of 127.0.0.1.

``stop()`` (fast shutdown) and ``start()`` (same port, same data) simulate an outage and a
recovery; ``create_database()`` gives each test its own empty database on the shared server.
PostgreSQL refuses to run as root: under root (CI) the cluster belongs to the ``postgres`` user
(else ``nobody``) and every binary runs as that user through ``setpriv`` (or ``runuser``).
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import quote

import psycopg
from psycopg import sql

from tests.server_process import free_port_block

# pg_ctl's own default wait (PGCTLTIMEOUT). The chaos soak restarts the server on a machine whose
# cores the vLLM workers keep busy: in one CI run the server wrote its first log line over 20 s
# after its launch, and a 20 s wait gave up on it 6 ms after that line, while it was starting.
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 10.0
DB_USER = "tandem"  # the cluster's bootstrap superuser (initdb -U); trust auth, no password
DEBIAN_BINARIES = Path("/usr/lib/postgresql")


class PostgresServer:
    """One ``postgres`` cluster; ``start()``/``stop()`` may be repeated, port and data kept."""

    def __init__(self, bindir: Path, port: int, workdir: Path) -> None:
        self._bindir = bindir
        self.port = port
        self._workdir = workdir
        self._datadir = workdir / "data"
        self._log = workdir / "postgres.log"
        self._as_user = _unprivileged_prefix(workdir)
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return self.database_url("postgres")

    def database_url(self, name: str) -> str:
        return f"postgresql://{DB_USER}@127.0.0.1:{self.port}/{quote(name, safe='')}"

    def initdb(self) -> None:
        """Create the cluster (UTF-8, C locale, trust auth); once, before the first ``start()``."""
        result = subprocess.run(
            [
                *self._as_user, str(self._bindir / "initdb"),
                "-D", str(self._datadir),
                "-U", DB_USER,
                "--auth=trust",
                "-E", "UTF8",
                "--locale=C",
                "--no-sync",
            ],
            cwd=self._workdir,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            check=False,
        )  # fmt: skip
        if result.returncode != 0:
            output = (result.stdout + result.stderr).decode(errors="replace")
            raise RuntimeError(f"initdb failed ({result.returncode}):\n{output}")

    def start(self) -> None:
        """Launch the server and return once it accepts connections."""
        if self._process is not None:
            raise RuntimeError("postgres already running")
        with self._log.open("ab") as log:
            self._process = subprocess.Popen(
                [
                    *self._as_user, str(self._bindir / "postgres"),
                    "-D", str(self._datadir),
                    "-p", str(self.port),
                    "-k", str(self._workdir),  # the unix socket, away from /var/run/postgresql
                    "-c", "listen_addresses=127.0.0.1",
                    "-c", "fsync=off",
                    "-c", "synchronous_commit=off",
                    "-c", "full_page_writes=off",
                    "-c", "max_connections=200",
                ],
                cwd=self._workdir,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )  # fmt: skip
        launched = time.monotonic()
        while not self._accepts_connections():
            exited = self._process.poll()
            waited_s = time.monotonic() - launched
            if exited is not None or waited_s > START_TIMEOUT_S:
                self.stop()
                why = f"exited with {exited}" if exited is not None else "no connection"
                output = self._log.read_text(errors="replace") if self._log.exists() else ""
                raise RuntimeError(
                    f"postgres did not start on port {self.port} ({why} after {waited_s:.1f} s):"
                    f"\n{output}"
                )
            time.sleep(0.05)

    def stop(self) -> None:
        """Fast shutdown: clients are disconnected, committed data stays for the next start."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        # Signal the postmaster itself: under runuser, the Popen child is runuser's watcher.
        pid = _postmaster_pid(self._datadir) or process.pid
        for signum in (signal.SIGINT, signal.SIGQUIT):  # fast, then immediate shutdown
            try:
                os.kill(pid, signum)
                process.wait(STOP_TIMEOUT_S)
                return
            except ProcessLookupError:
                break
            except subprocess.TimeoutExpired:
                continue
        process.kill()
        process.wait()

    def close(self) -> None:
        """Stop the server and delete its cluster."""
        self.stop()
        shutil.rmtree(self._workdir, ignore_errors=True)

    def create_database(self, name: str) -> str:
        """Create an empty database ``name`` (it must not exist yet) and return its URL."""
        with psycopg.connect(self.url, autocommit=True) as conn:
            # template0: template1 may be in use, and CREATE DATABASE needs its source unused.
            conn.execute(
                sql.SQL("CREATE DATABASE {} TEMPLATE template0").format(sql.Identifier(name))
            )
        return self.database_url(name)

    def _accepts_connections(self) -> bool:
        try:
            with psycopg.connect(self.url, connect_timeout=2):
                return True
        except psycopg.OperationalError:
            return False


@contextmanager
def running_postgres() -> Iterator[PostgresServer]:
    """A started server on a free port, stopped and deleted on exit.

    Fails the test (never skips it) when PostgreSQL is not installed.
    """
    bindir = find_bindir()
    if bindir is None:
        # Imported here: bench.ledger starts this server too, from an install without pytest.
        import pytest

        pytest.fail(
            "PostgreSQL is not installed (no initdb on PATH or under /usr/lib/postgresql/*/bin): "
            "run scripts/install --dev; the billing ledger tests run against a real server and "
            "are never skipped",
            pytrace=False,
        )
    server = PostgresServer(bindir, free_port_block(1), Path(tempfile.mkdtemp(prefix="tandem-pg-")))
    try:
        server.initdb()
        server.start()
        yield server
    finally:
        server.close()


def find_bindir() -> Path | None:
    """The directory of ``initdb`` and ``postgres``: PATH's first, else Debian's newest."""
    candidates: list[Path] = []
    if on_path := shutil.which("initdb"):
        candidates += [Path(on_path).resolve().parent, Path(on_path).parent]
    candidates += sorted(DEBIAN_BINARIES.glob("*/bin"), key=_version, reverse=True)
    for bindir in candidates:
        if (bindir / "initdb").is_file() and (bindir / "postgres").is_file():
            return bindir
    return None


def _version(bindir: Path) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in bindir.parent.name.split("."))
    except ValueError:
        return ()


def _unprivileged_prefix(workdir: Path) -> list[str]:
    """The command prefix that runs a binary as an unprivileged user, who is given ``workdir``.

    Empty unless we are root (then the ``postgres`` user, else ``nobody``).
    """
    if os.geteuid() != 0:
        return []
    try:
        user = pwd.getpwnam("postgres")
    except KeyError:
        user = pwd.getpwnam("nobody")
    os.chown(workdir, user.pw_uid, user.pw_gid)
    if shutil.which("setpriv"):  # execs the binary: the Popen child is the postmaster
        ids = [f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups"]
        return ["setpriv", *ids, "--"]
    return ["runuser", "-u", user.pw_name, "--"]


def _postmaster_pid(datadir: Path) -> int | None:
    try:
        return int((datadir / "postmaster.pid").read_text().split("\n", 1)[0])
    except (OSError, ValueError):
        return None
