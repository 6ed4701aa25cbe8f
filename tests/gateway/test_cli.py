from __future__ import annotations

import socket

import pytest

from gateway.assembly.settings import TandemSettings
from gateway.cli.main import _parser, _port_is_free, _settings_from_args, main


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


def test_invalid_setting_names_the_field(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_PORT", "70000")
    with pytest.raises(ValueError, match="port"):
        TandemSettings()


def test_port_probe() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        assert not _port_is_free("127.0.0.1", busy.getsockname()[1])


def test_version_and_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["version"]) == 0
    assert "tandem" in capsys.readouterr().out
    assert main([]) == 2
