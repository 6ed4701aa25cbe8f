"""The shutdown log filter (``workers/vllm_shutdown.py``) on a stand-in for vLLM's AsyncLLM:
the output handler's failure record is dropped only when a shutdown began and the error is the
engine's death; and the plugin finds the real classes in the installed vLLM."""

from __future__ import annotations

import importlib
import logging
from typing import Any

import pytest

from workers import vllm_shutdown
from workers.vllm_shutdown import FAILED_MESSAGE, install


class EngineDead(Exception):
    pass


class FakeAsyncLLM:
    """Logs as vLLM's output handler does when the engine's outputs raise."""

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger
        self.stopped = False

    def output_handler_fails(self, error: BaseException) -> None:
        try:
            raise error
        except BaseException:
            self.logger.exception(FAILED_MESSAGE)

    def shutdown(self, timeout: float | None = None) -> None:
        self.stopped = True
        self.output_handler_fails(EngineDead("engine core stopped"))


def _fresh_class() -> type[FakeAsyncLLM]:
    return type("FakeAsyncLLM", (FakeAsyncLLM,), {})


def test_the_engine_death_a_shutdown_causes_is_not_logged_as_a_failure(
    caplog: pytest.LogCaptureFixture,
) -> None:
    logger = logging.getLogger("tests.fake_async_llm.shutdown")
    engine_cls = _fresh_class()
    assert install(engine_cls, EngineDead, logger)
    engine = engine_cls(logger)
    with caplog.at_level(logging.DEBUG):
        engine.shutdown(timeout=10)
    assert engine.stopped, "the original shutdown ran"
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert "stopped by the engine's shutdown" in caplog.text


def test_an_engine_death_without_a_shutdown_or_another_error_still_logs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    logger = logging.getLogger("tests.fake_async_llm.crash")
    engine_cls = _fresh_class()
    install(engine_cls, EngineDead, logger)
    engine = engine_cls(logger)
    engine.output_handler_fails(EngineDead("the engine crashed"))
    [crash] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert crash.exc_info is not None and isinstance(crash.exc_info[1], EngineDead)
    caplog.clear()
    engine.shutdown()
    engine.output_handler_fails(ValueError("a bug while shutting down"))
    [bug] = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert bug.exc_info is not None and isinstance(bug.exc_info[1], ValueError)


def test_installing_twice_changes_nothing_more() -> None:
    logger = logging.getLogger("tests.fake_async_llm.twice")
    engine_cls = _fresh_class()
    assert install(engine_cls, EngineDead, logger)
    assert not install(engine_cls, EngineDead, logger)
    assert len(logger.filters) == 1


def test_the_plugin_finds_vllms_own_classes() -> None:
    """Against the installed vLLM: if its layout moves, this says so (the plugin would then
    quietly do nothing)."""
    async_llm: Any = importlib.import_module("vllm.v1.engine.async_llm")
    original = async_llm.AsyncLLM.shutdown
    logger = logging.getLogger(async_llm.__name__)
    filters = list(logger.filters)
    try:
        vllm_shutdown.register()
        assert getattr(async_llm.AsyncLLM.shutdown, "_tandem_marks_shutdown", False)
        assert async_llm.AsyncLLM.shutdown.__wrapped__ is original
    finally:
        async_llm.AsyncLLM.shutdown = original
        logger.filters[:] = filters
