"""A stand-in for a vLLM OpenAI server in supervision tests. Standard library only.

Accepts vLLM's command line (reads ``--host`` and ``--port``, ignores the rest) and answers
``GET /health``. Like vLLM, it spawns a child of its own (a ``sleep``) so tests can prove that
no grandchild outlives a stop, and on SIGTERM it stops that child and exits, as vLLM stops its
engine core. Behaviour is steered by environment variables:

    FAKE_WORKER_ENGINE_RECORD   the child is an engine-core stand-in instead of a ``sleep``: it
                                writes {"ready": true} here once it can take SIGTERM, then, on
                                SIGTERM, {"signal": "SIGTERM", "sender_pid": <who sent it>}

    FAKE_WORKER_INFO_FILE       write {"pid", "grandchild_pid", "argv", "env"} here (JSON)
    FAKE_WORKER_EXIT_CODE       print a line and exit with this code instead of serving
    FAKE_WORKER_HEALTH_STATUS   HTTP status of /health (default 200)
    FAKE_WORKER_IGNORE_SIGTERM  "1": ignore SIGTERM (the supervisor must escalate to SIGKILL)
    FAKE_WORKER_ESCAPE_GROUP    "1": put the grandchild in its own session, outside our group
    FAKE_WORKER_STOP_S          on SIGTERM, stop listening (connections are refused) and take
                                this many seconds to exit, as vLLM does while its engine stops
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType


def engine_core(record: Path) -> None:
    """Wait for SIGTERM and record who sent it (the supervisor, or the fake server)."""
    # Blocked and taken with sigwaitinfo: a handler cannot see the sender's pid.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    _write_atomically(record, {"ready": True})
    info = signal.sigwaitinfo({signal.SIGTERM})
    _write_atomically(record, {"signal": "SIGTERM", "sender_pid": info.si_pid})


def _write_atomically(path: Path, data: dict[str, object]) -> None:
    # Write then rename so a reader never sees a half-written file.
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def main() -> None:
    if sys.argv[1:2] == ["--engine-core"]:
        engine_core(Path(sys.argv[2]))
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args, _ = parser.parse_known_args()

    if code := os.environ.get("FAKE_WORKER_EXIT_CODE"):
        print(f"fake worker: failing at startup with code {code}", flush=True)
        sys.exit(int(code))

    record = os.environ.get("FAKE_WORKER_ENGINE_RECORD")
    grandchild = subprocess.Popen(
        [sys.executable, __file__, "--engine-core", record] if record else ["sleep", "600"],
        start_new_session=os.environ.get("FAKE_WORKER_ESCAPE_GROUP") == "1",
    )

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        # A second SIGTERM (seen here: the parent-death signal plus one more for an orphan)
        # must not re-enter: a nested Popen.wait deadlocks on the lock the outer one holds.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if stop_s := float(os.environ.get("FAKE_WORKER_STOP_S", "0")):
            server.socket.close()
            time.sleep(stop_s)
        grandchild.terminate()
        grandchild.wait()
        sys.exit(0)

    ignore = os.environ.get("FAKE_WORKER_IGNORE_SIGTERM") == "1"
    signal.signal(signal.SIGTERM, signal.SIG_IGN if ignore else on_sigterm)

    health_status = int(os.environ.get("FAKE_WORKER_HEALTH_STATUS", "200"))

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            status = health_status if self.path == "/health" else 404
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *log_args: object) -> None:
            pass  # health polls would flood the worker log

    server = http.server.ThreadingHTTPServer((args.host, args.port), Handler)
    if info_file := os.environ.get("FAKE_WORKER_INFO_FILE"):
        info = {
            "pid": os.getpid(),
            "grandchild_pid": grandchild.pid,
            "argv": sys.argv[1:],
            "env": {k: v for k, v in os.environ.items() if k.startswith(("VLLM_", "HF_"))},
        }
        _write_atomically(Path(info_file), info)  # restarts rewrite it
    print(f"fake worker listening on {args.host}:{args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
