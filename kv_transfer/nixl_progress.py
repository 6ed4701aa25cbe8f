"""A vLLM plugin for NIXL on CPU workers: its UCX progress thread must not spin a core on every
idle worker, its threads must not take the model's core from the model's thread, and its
connector must not move the model off the core the worker is pinned to.

NIXL's Python agent (``nixl._api.nixl_agent``, nixl 1.x) hard-codes ``pthrDelay = 0``. Its
progress thread then polls the UCX workers' event fds with a zero timeout: each idle vLLM worker
burns a whole core (seen with gdb: ``epoll_wait(timeout=0)`` in a loop), and vLLM offers no
setting for it. The thread is event-driven (a transfer or notification wakes it through those
fds); the delay is only its periodic wake-up, which NIXL keeps against a UCX bug that can miss an
fd event. A delay of a millisecond keeps that safety net and idles at ~3 % of a core.

The threads: a decode worker READs KV in its model's thread (UCX copies inside the post; NIXL
hands a transfer to its own threads only from 1,024 descriptors). NIXL's UCX progress thread
wakes on every completion of that transfer and progresses the same UCX worker, on the same
core, since a pinned worker's threads inherit its binding: measured with ``perf sched`` on a
2-core host, it took 4.9 ms of a 16.8 ms read of a 1k-token prompt, more than the copying
thread's own 4.4 ms. Where Tandem asks (``NICE_ENV``), every thread NIXL starts while an agent is
built (its listener, progress, UCX async and worker threads) gets that nice value, so it runs
when the model's thread does not want the core; it still runs at once on an idle core. Raising
a thread's nice value needs no privilege.

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
``DELAY_ENV`` or ``NICE_ENV`` (``kv_transfer.connector.connector_env``) or ``KEEP_BINDING_ENV``
(``workers.process``), so other vLLM servers sharing this environment are left alone.
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
NICE_ENV = "TANDEM_NIXL_THREAD_NICE"
"""Nice value (0-19) of the threads NIXL starts; unset leaves them at the worker's."""
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


def thread_ids(pid: int | str = "self") -> set[int]:
    """The kernel ids of a process's threads (this one's by default). Each is also what
    ``os.getpriority``/``setpriority`` take to read or set that one thread's nice value."""
    return {int(name) for name in os.listdir(f"/proc/{pid}/task")}


def yielding_threads(init: Callable[..., None], nice: int) -> Callable[..., None]:
    """``nixl_agent.__init__``, except that the threads started while it runs get ``nice``.

    A thread's nice value is its own on Linux (``setpriority`` with a thread id). The agent is
    built once per worker, from its main thread, while the connector starts; a thread some other
    part of the worker started in that moment would get ``nice`` too, which costs it priority,
    never correctness. A thread already above ``nice`` keeps its value.
    """

    def __init__(agent: Any, *args: Any, **kwargs: Any) -> None:
        before = thread_ids()
        init(agent, *args, **kwargs)
        started = sorted(thread_ids() - before)
        for tid in started:
            try:
                if os.getpriority(os.PRIO_PROCESS, tid) < nice:
                    os.setpriority(os.PRIO_PROCESS, tid, nice)
            except ProcessLookupError:  # a thread that ended already
                continue
        log.info("NIXL agent: %d threads it started run at nice %d", len(started), nice)

    __init__.tandem_nice = nice  # type: ignore[attr-defined]
    __init__.__wrapped__ = init  # type: ignore[attr-defined]
    return __init__


def install_nice(api: ModuleType, nice: int) -> bool:
    """Give the threads of every agent ``api`` builds from now on ``nice``; False if it cannot.

    ``api`` is NIXL's ``_api`` module. Installing twice only updates the value.
    """
    agent_class = getattr(api, "nixl_agent", None)
    if agent_class is None:
        log.warning(
            "NIXL's _api has no nixl_agent (a newer NIXL?); its threads keep the worker's "
            "priority. Unset %s to silence this.",
            NICE_ENV,
        )
        return False
    init = agent_class.__init__
    agent_class.__init__ = yielding_threads(getattr(init, "__wrapped__", init), nice)
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


def parse_nice(raw: str) -> int:
    """The nice value from the environment's text; ValueError says what is accepted."""
    try:
        nice = int(raw)
    except ValueError:
        raise ValueError(f"{NICE_ENV} must be a whole number from 0 to 19, got {raw!r}") from None
    if not 0 <= nice <= 19:
        raise ValueError(
            f"{NICE_ENV} must be from 0 (the worker's priority) to 19 (the lowest), got {nice}"
        )
    return nice


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
    """vLLM's plugin hook: keep the worker's binding, and install the delay and the threads'
    nice value, each where Tandem asked."""
    if os.environ.get(KEEP_BINDING_ENV) and not getattr(
        os.sched_setaffinity, "tandem_keeps_binding", False
    ):
        os.sched_setaffinity = keeping_binding(os.sched_setaffinity)
    raw_delay, raw_nice = os.environ.get(DELAY_ENV), os.environ.get(NICE_ENV)
    if raw_delay is None and raw_nice is None:
        return
    # Parsed before NIXL is imported: a bad value fails the worker's start, naming the variable.
    delay_us = None if raw_delay is None else parse_delay(raw_delay)
    nice = None if raw_nice is None else parse_nice(raw_nice)
    try:
        # nixl/__init__ puts the build for this machine (nixl_cu12._api, ...) at nixl._api.
        api = importlib.import_module("nixl._api")
    except ImportError:
        asked = DELAY_ENV if raw_nice is None else NICE_ENV
        log.warning("%s is set but NIXL is not installed; nothing to do", asked)
        return
    if delay_us is not None:
        install(api, delay_us)
    if nice is not None:
        install_nice(api, nice)
