from __future__ import annotations

import socket
from pathlib import Path

import pytest
from pydantic import ValidationError

from gateway.assembly.settings import TandemSettings
from gateway.assembly.stack import Stack, moderation_setup
from gateway.assembly.supervisor import connector_config, port_is_free
from gateway.cli.main import _parser, _settings_from_args, main
from kv_transfer.connector import connector_env
from moderation.stream import StreamConfig
from tests.fakes.model_folder import fake_version
from workers.process import worker_argv


def test_flags_override_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_PORT", "9000")
    monkeypatch.setenv("TANDEM_NUM_DECODE_WORKERS", "3")
    args = _parser().parse_args(
        ["up", "--port", "9100", "--prefill-url", "http://a:1/", "--prefill-url", "http://b:2",
         "--enforce-eager"]
    )  # fmt: skip
    settings = _settings_from_args(args)
    assert settings.port == 9100
    assert settings.num_decode_workers == 3  # from the environment: no flag given
    assert settings.prefill_urls == ["http://a:1", "http://b:2"]
    assert settings.enforce_eager is True


def test_url_lists_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_DECODE_URLS", "http://gpu-a:8000/, http://gpu-b:8000")
    monkeypatch.setenv("TANDEM_CPU_BINDING", "0-3,4-7")
    settings = TandemSettings()
    assert settings.decode_urls == ["http://gpu-a:8000", "http://gpu-b:8000"]
    assert settings.cpu_binding == ["0-3", "4-7"]


@pytest.mark.parametrize("variable", ["TANDEM_DECODE_URLS", "TANDEM_PREFILL_URLS"])
def test_a_worker_url_the_gateway_could_not_call_is_refused_at_start(
    monkeypatch: pytest.MonkeyPatch, variable: str
) -> None:
    # Without a scheme the worker would only ever be found unhealthy (503 no_healthy_worker).
    monkeypatch.setenv(variable, "http://gpu-a:8000, gpu-b:8000")
    with pytest.raises(ValidationError, match=r"http\(s\)://host\[:port\].*'gpu-b:8000'"):
        TandemSettings()


def test_invalid_setting_names_the_field(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_PORT", "70000")
    with pytest.raises(ValueError, match="port"):
        TandemSettings()


def test_ucx_transports_reach_every_worker_and_a_useless_list_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TANDEM_UCX_TRANSPORTS", "cma,tcp")
    config = connector_config(TandemSettings())
    assert connector_env(config, "127.0.0.1", 5600)["UCX_TLS"] == "cma,tcp"
    monkeypatch.delenv("TANDEM_UCX_TRANSPORTS")
    assert "UCX_TLS" not in connector_env(connector_config(TandemSettings()), "127.0.0.1", 5600)
    # Shared memory alone: NIXL cannot start.
    monkeypatch.setenv("TANDEM_UCX_TRANSPORTS", "posix,sysv")
    with pytest.raises(ValueError, match="add 'tcp'"):
        TandemSettings()


def test_moderation_window_and_batch_reach_the_stream_config(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert moderation_setup(TandemSettings()).stream == StreamConfig(48, 48, 0)
    monkeypatch.setenv("TANDEM_MODERATION_WINDOW_CHARS", "64")
    monkeypatch.setenv("TANDEM_MODERATION_BATCH_CHARS", "16")
    assert moderation_setup(TandemSettings()).stream == StreamConfig(64, 64, 16)
    monkeypatch.setenv("TANDEM_MODERATION_BATCH_CHARS", "-1")
    with pytest.raises(ValidationError, match="moderation_batch_chars"):
        TandemSettings()


def test_port_probe() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        assert not port_is_free("127.0.0.1", busy.getsockname()[1])


def test_version_and_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["version"]) == 0
    assert "tandem" in capsys.readouterr().out
    assert main([]) == 2


def test_managed_workers_get_the_step_budget_and_extra_flags(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("TANDEM_WORKER_EXTRA_ARGS", "--num-gpu-blocks-override 9 --seed '7'")
    monkeypatch.setenv("TANDEM_DECODE_STEP_TOKENS", "48")
    version = fake_version(tmp_path)
    stack = Stack.from_settings(TandemSettings(), version)
    [prefill] = [worker_argv(spec) for spec in stack.prefill.config.specs]
    [decode] = [worker_argv(spec) for spec in stack.decode.config.specs]
    for argv in (prefill, decode):
        assert argv[-4:] == ["--num-gpu-blocks-override", "9", "--seed", "7"]
    assert decode[decode.index("--max-num-batched-tokens") + 1] == "48"
    assert "--max-num-batched-tokens" not in prefill  # prefill workers run no streams
    monkeypatch.setenv("TANDEM_DECODE_STEP_TOKENS", "0")  # vLLM's own budget
    stack = Stack.from_settings(TandemSettings(), version)
    assert all(
        "--max-num-batched-tokens" not in worker_argv(spec) for spec in stack.decode.config.specs
    )


def test_external_workers_count_prompts_with_the_tokenizer_named(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("TANDEM_NUM_PREFILL_WORKERS", "0")
    monkeypatch.setenv("TANDEM_NUM_DECODE_WORKERS", "0")
    monkeypatch.setenv("TANDEM_DECODE_URLS", "http://gpu-a:8000")
    monkeypatch.setenv("TANDEM_SERVED_MODEL_NAME", "served")
    assert Stack.from_settings(TandemSettings(), None).model_dir is None  # 4 characters a token
    (tmp_path / "tokenizer.json").write_text("{}")
    monkeypatch.setenv("TANDEM_TOKENIZER_DIR", str(tmp_path))
    assert Stack.from_settings(TandemSettings(), None).model_dir == tmp_path
    # A managed version counts with its own folder's tokenizer.
    version = fake_version(tmp_path / "model")
    monkeypatch.setenv("TANDEM_NUM_DECODE_WORKERS", "1")
    assert Stack.from_settings(TandemSettings(), version).model_dir == Path(version.model_dir)
    monkeypatch.setenv("TANDEM_TOKENIZER_DIR", str(tmp_path / "elsewhere"))
    with pytest.raises(ValidationError, match=r"has no tokenizer\.json"):
        TandemSettings()
