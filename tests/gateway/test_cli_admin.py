"""``tandem admin`` against a real gateway (fake engines): the CLI drives the admin API."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import openai
import pytest

from gateway.cli.main import main
from tests.gateway.conftest import MODEL, FakeStack, run_cli

QUESTION = [{"role": "user", "content": "hello"}]


async def _tandem(
    capsys: pytest.CaptureFixture[str], stack: FakeStack, *argv: str
) -> tuple[int, str, str]:
    return await run_cli(capsys, stack, "admin", *argv)


async def test_create_issue_use_and_revoke_from_the_cli(
    fake_stack: FakeStack, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = await _tandem(
        capsys, fake_stack, "tenants", "create", "acme", "--tpm", "5000", "--band", "interactive"
    )
    assert code == 0
    created = json.loads(out)
    assert created["plan"]["tpm"] == 5000 and created["plan"]["band"] == "interactive"

    code, out, err = await _tandem(capsys, fake_stack, "keys", "issue", "acme", "--name", "ci")
    assert code == 0 and "shown this once" in err
    issued = json.loads(out)
    assert next(iter(issued)) == "key"  # the secret first, not the look-alike display_prefix
    async with fake_stack.client_for(issued["key"]) as client:
        reply = await client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2)
        assert reply.choices[0].message.content

        code, out, _ = await _tandem(
            capsys, fake_stack, "tenants", "update", "acme", "--tpm", "unlimited"
        )
        assert code == 0 and json.loads(out)["plan"]["tpm"] is None

        code, out, _ = await _tandem(capsys, fake_stack, "keys", "list", "acme")
        assert code == 0 and issued["key_id"] in out and issued["key"] not in out

        code, _, _ = await _tandem(capsys, fake_stack, "keys", "revoke", issued["key_id"])
        assert code == 0
        await asyncio.sleep(0.6)  # past the gateway's key cache
        with pytest.raises(openai.AuthenticationError):
            await client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2)

    code, out, _ = await _tandem(capsys, fake_stack, "usage", "acme")
    assert code == 0 and json.loads(out)["name"] == "acme"


async def test_errors_are_one_line_and_exit_1(
    fake_stack: FakeStack, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = await _tandem(capsys, fake_stack, "tenants", "show", "nobody")
    assert code == 1 and "404" in err and "nobody" in err
    code = await asyncio.to_thread(
        main, ["admin", "--url", fake_stack.base_url, "--admin-key", "wrong", "tenants", "list"]
    )
    assert code == 1 and "401" in capsys.readouterr().err


def test_admin_key_comes_from_the_state_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("TANDEM_ADMIN_KEY", raising=False)
    monkeypatch.setenv("TANDEM_STATE_DIR", str(tmp_path / "none-here"))
    code = main(["admin", "--url", "http://127.0.0.1:9", "tenants", "list"])
    assert code == 1 and "no admin key" in capsys.readouterr().err
