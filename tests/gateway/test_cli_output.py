"""What ``tandem admin`` writes where: the answer alone on stdout, logs on stderr, keys first.

The streams are checked on a real ``python -m tandem`` process against a real gateway (fake
engines): in-process, pytest's own logging capture would decide where log records go.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import sys
from pathlib import Path

from rich.console import Console

from gateway.cli.admin import show_issued_key
from tests.gateway.conftest import ADMIN_KEY, FakeStack

REPO = Path(__file__).resolve().parents[2]
ISSUED = {
    "key_id": "key_0123456789abcdef",
    "tenant_id": "ten_0123456789abcdef",
    "name": "ci",
    "display_prefix": "tdm-AbCdEfGh",
    "created_at": 1795558101.06,
    "revoked_at": None,
    "last_used_at": None,
    "key": "tdm-AbCdEfGhIjKlMnOpQrStUvWxYz0123456789_-abcdefgh",
}


async def _tandem(stack: FakeStack, *argv: str, log_level: str | None = None) -> tuple[str, str]:
    """Run ``tandem admin --url <stack> --admin-key ... [--log-level L] <argv>``: stdout, stderr."""
    level = ["--log-level", log_level] if log_level else []
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tandem", "admin", "--url", stack.base_url,
        "--admin-key", ADMIN_KEY, *level, *argv,
        cwd=REPO, env={**os.environ, "NO_COLOR": "1"},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode == 0, err.decode()
    return out.decode(), err.decode()


async def test_stdout_is_exactly_the_answer_and_logs_stay_off_by_default(
    fake_stack: FakeStack,
) -> None:
    out, err = await _tandem(fake_stack, "tenants", "create", "quiet")
    created = json.loads(out)  # the whole of stdout is one JSON document
    assert created["name"] == "quiet"
    assert out.lstrip().startswith("{")
    assert "HTTP Request" not in out + err
    assert " INFO " not in err

    out, err = await _tandem(fake_stack, "tenants", "show", "quiet", log_level="info")
    assert json.loads(out)["name"] == "quiet"
    assert "HTTP Request: GET" in err  # asked for: the logs come, on stderr only


async def test_issued_key_json_starts_with_the_key(fake_stack: FakeStack) -> None:
    await _tandem(fake_stack, "tenants", "create", "keyed")
    out, err = await _tandem(fake_stack, "keys", "issue", "keyed")
    issued = json.loads(out)
    assert next(iter(issued)) == "key"
    assert issued["key"].startswith("tdm-") and issued["key"].startswith(issued["display_prefix"])
    assert "shown this once" in err


def test_issued_key_on_a_terminal_says_which_is_the_key() -> None:
    screen = io.StringIO()
    # Narrower than the key: it must still be one line, whole, so it can be copied.
    show_issued_key(Console(file=screen, force_terminal=True, no_color=True, width=40), ISSUED)
    lines = screen.getvalue().splitlines()
    assert lines[0] == f"key (shown once): {ISSUED['key']}"
    assert "key_0123456789abcdef" in lines[1]
    # The prefix also starts with tdm-: it is labelled, and never on a line of its own.
    (prefix_line,) = [line for line in lines if "tdm-AbCdEfGh..." in line]
    assert prefix_line.startswith("listed by `keys list` as:")


def test_issued_key_in_a_pipe_is_json_with_the_key_first() -> None:
    piped = io.StringIO()
    show_issued_key(Console(file=piped, force_terminal=False), ISSUED)
    issued = json.loads(piped.getvalue())
    assert list(issued) == ["key", *(name for name in ISSUED if name != "key")]
    assert issued == ISSUED
