"""A vLLM plugin for NIXL on CPU workers: its UCX progress thread must not spin a core on every
idle worker, and its connector must not move the model off the core the worker is pinned to.

NIXL's Python agent (``nixl._api.nixl_agent``, nixl 1.x) hard-codes ``pthrDelay = 0``. Its
progress thread then polls the UCX workers' event fds with a zero timeout: each idle vLLM worker
burns a whole core (seen with gdb: ``epoll_wait(timeout=0)`` in a loop), and vLLM offers no
setting for it. The thread is event-driven (a transfer or notification wakes it through those
fds); the delay is only its periodic wake-up, which NIXL keeps against a UCX bug that can miss an
fd event. A delay of a millisecond keeps that safety net and idles at ~3 % of a core.

The binding: on CPU, vLLM's NIXL connector worker "reserves" the last core of each NUMA node for
KV loads by calling ``os.sched_setaffinity(0, [last cores])`` from the worker's main thread
(``vllm/distributed/kv_transfer/kv_connector/v1/nixl/base_worker.py``). That thread is also the
one that runs the model (with ``VLLM_CPU_OMP_THREADS_BIND`` giving one core, OpenMP's only
thread is the main thread), so every worker ends up computing on the last core, whatever its
binding, and the other cores idle: seen on 2 cores, three workers' main threads on core 1, a
runtime-deployed worker starved for minutes next to a loaded one. Where Tandem pinned the worker
(``KEEP_BINDING_ENV``), that one call is skipped and the main thread stays where OpenMP put it.

vLLM loads this module's ``register`` in each of its processes through the
``vllm.general_plugins`` entry point (``pyproject.toml``). It acts only where Tandem set
``TANDEM_NIXL_PROGRESS_DELAY_US`` (``kv_transfer.connector.connector_env``) or
``KEEP_BINDING_ENV`` (``workers.process``), so other vLLM servers sharing this environment are
left alone.
"""

from __future__ import annotations

import importlib
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

DELAY_ENV = "TANDEM_NIXL_PROGRESS_DELAY_US"
"""Poll timeout of NIXL's progress thread, in µs; unset leaves NIXL as it is."""
KEEP_BINDING_ENV = "TANDEM_KEEP_CPU_BINDING"
"""Set (to 1) on workers Tandem pinned: NIXL's connector may not move their main thread."""
_NIXL_MODULES = "vllm.distributed.kv_transfer.kv_connector.v1.nixl"

# A child of "vllm": vLLM configures that logger (handler, level) in each of its processes, and
# this module runs only there; the name is all it takes, vllm is never imported.
log = logging.getLogger("vllm.tandem_nixl_progress")


class DelayedAgentBinding:
    """NIXL's native binding module, except that every agent it creates gets ``pthrDelay``.

    ``nixl_agent.__init__`` fills a ``nixlAgentConfig``, forces ``pthrDelay = 0``, then calls
    ``nixlBind.nixlAgent(name, config)``: this is the last point where the delay can be set.
    Every other attribute is the binding's own.
    """

    def __init__(self, binding: ModuleType, delay_us: int) -> None:
        self._binding = binding
        self.delay_us = delay_us

    def __getattr__(self, name: str) -> Any:
        return getattr(self._binding, name)

    def nixlAgent(self, name: str, config: Any) -> Any:  # the binding's own name
        if config.useProgThread:
            config.pthrDelay = self.delay_us
            log.info("NIXL agent %s: progress thread polls every %d us", name, self.delay_us)
        return self._binding.nixlAgent(name, config)


def install(api: ModuleType, delay_us: int) -> bool:
    """Route ``api``'s agent creation through ``DelayedAgentBinding``; False if it cannot.

    ``api`` is NIXL's ``_api`` module. Installing twice only updates the delay.
    """
    binding = getattr(api, "nixlBind", None)
    if isinstance(binding, DelayedAgentBinding):
        binding.delay_us = delay_us
        return True
    if binding is None or not hasattr(binding, "nixlAgent"):
        log.warning(
            "NIXL's _api has no nixlBind.nixlAgent (a newer NIXL?); its progress thread keeps "
            "NIXL's own delay. Unset %s to silence this.",
            DELAY_ENV,
        )
        return False
    api.nixlBind = DelayedAgentBinding(binding, delay_us)  # type: ignore[attr-defined]
    return True


def parse_delay(raw: str) -> int:
    """The delay in µs from the environment's text; ValueError says what is accepted."""
    try:
        delay = int(raw)
    except ValueError:
        raise ValueError(
            f"{DELAY_ENV} must be a whole number of microseconds, got {raw!r}"
        ) from None
    if delay < 0:
        raise ValueError(f"{DELAY_ENV} must be >= 0 (0 is NIXL's busy poll), got {delay}")
    return delay


Affinity = Callable[[int, Iterable[int]], None]


def keeping_binding(setaffinity: Affinity) -> Affinity:
    """``os.sched_setaffinity``, except that NIXL's connector moving the calling main thread
    (``pid`` 0, called from a module under ``vllm...nixl``) is skipped (see the module
    docstring). Every other call goes through."""

    def sched_setaffinity(pid: int, mask: Iterable[int]) -> None:
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if (
            pid == 0
            and threading.current_thread() is threading.main_thread()
            and caller.startswith(_NIXL_MODULES)
        ):
            log.info(
                "kept the worker's CPU binding: NIXL's connector asked to move the model's "
                "thread to cores %s",
                sorted(mask),
            )
            return
        setaffinity(pid, mask)

    sched_setaffinity.tandem_keeps_binding = True  # type: ignore[attr-defined]
    return sched_setaffinity


def register() -> None:
    """vLLM's plugin hook: keep the worker's binding and install the delay where Tandem asked."""
    if os.environ.get(KEEP_BINDING_ENV) and not getattr(
        os.sched_setaffinity, "tandem_keeps_binding", False
    ):
        os.sched_setaffinity = keeping_binding(os.sched_setaffinity)
    raw = os.environ.get(DELAY_ENV)
    if raw is None:
        return
    delay_us = parse_delay(raw)
    try:
        # nixl/__init__ puts the build for this machine (nixl_cu12._api, ...) at nixl._api.
        api = importlib.import_module("nixl._api")
    except ImportError:
        log.warning("%s is set but NIXL is not installed; nothing to do", DELAY_ENV)
        return
    install(api, delay_us)
