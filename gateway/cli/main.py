"""The gateway's commands of ``tandem`` (the whole command, ``bench`` included, is ``tandem.cli``).

tandem up                 prepare the model, boot a prefill and a decode worker, serve the gateway
tandem model prepare      convert the model into a vLLM-loadable folder (idempotent)
tandem model register ... versions: register, list, show, delete, deploy, undeploy, figures
tandem traffic ...        traffic policies per alias (split, sticky, pins, shadow)
tandem audit              who changed versions, deployments and policies, and why
tandem rollout ...        canary a version behind gates: start, status, pause, promote, report
tandem planner status     the autoscaling planner: each version's pools, what it wants and why
tandem admin ...          tenants, keys, quotas and usage over the admin API
tandem version

Logs go to standard error, at ``--log-level`` (``info`` for ``up``, ``warning`` for the others):
standard output holds only what a command was asked for, so ``tandem admin ... | jq`` works.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import uvicorn
from rich.console import Console
from rich.status import Status

from gateway.assembly.config_file import ConfigFileError, load_stack_file
from gateway.assembly.gateway_processes import (
    STOP_TIMEOUT_S,
    Cover,
    GatewayProcessError,
    GatewayProcesses,
    adopt_orphan_spools,
    default_gateway_workers,
    handoffs,
    listening_socket,
    own_socket,
    process_headers,
    write_process_list,
)
from gateway.assembly.redis_server import OwnedRedis, RedisServerError
from gateway.assembly.settings import TandemSettings
from gateway.assembly.stack import Stack, planner_config, request_limits
from gateway.assembly.supervisor import fingerprint, port_is_free
from gateway.cli.admin import (
    add_admin_parser,
    add_connection_flags,
    add_log_level_flag,
    run_admin,
)
from gateway.cli.billing import add_billing_parser, run_billing
from gateway.cli.http_protocol import limited_httptools
from gateway.cli.models import (
    add_model_commands,
    add_traffic_parsers,
    run_audit,
    run_model,
    run_traffic,
)
from gateway.cli.planner import add_planner_parser, run_planner
from gateway.cli.rollouts import add_rollout_parser, run_rollout
from gateway.cli.serve import Server, run_event_loop, tune_garbage_collector
from planner.profile import ProfileError
from telemetry.otlp_env import TelemetryConfigError
from versions.records import VersionSourceError
from workers.model import ModelPreparationError, RichProgress, prepare_model
from workers.pool import WorkerStartupError, WorkerStatus

console = Console(stderr=True)


def main(argv: Sequence[str] | None = None) -> int:
    """The gateway's commands alone (``tandem.cli.main`` adds ``bench``)."""
    parser = _parser()
    code = run_command(parser.parse_args(argv))
    if code is None:
        parser.print_help()
        return 2
    return code


def run_command(args: argparse.Namespace) -> int | None:
    """Run a gateway command; None when ``args.command`` is not one of them."""
    log_level: str = getattr(args, "log_level", None) or "warning"
    # Standard error, never standard output: that is the command's answer (JSON, an export).
    logging.basicConfig(
        level=log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        if args.command == "up":
            return run_event_loop(_up(_settings_from_args(args), log_level))
        if args.command == "model" and args.model_command == "prepare":
            with RichProgress(console) as progress:
                prepared = prepare_model(args.model, cache_dir=args.cache_dir, progress=progress)
            console.print(
                f"model ready: [bold]{prepared.path}[/] (served as {prepared.served_name})"
            )
            return 0
        if args.command == "model" and args.model_command is not None:
            return run_model(args)
        if args.command == "traffic":
            return run_traffic(args)
        if args.command == "audit":
            return run_audit(args)
        if args.command == "rollout":
            return run_rollout(args)
        if args.command == "planner":
            return run_planner(args)
        if args.command == "admin":
            return run_admin(args)
        if args.command == "billing":
            return run_billing(args)
        if args.command == "version":
            print("tandem 0.1.0")
            return 0
    except ModelPreparationError as exc:
        console.print(f"[red]model preparation failed:[/] {exc}")
        return 1
    return None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem")
    add_commands(parser.add_subparsers(dest="command"))
    return parser


def add_commands(commands: Any) -> None:
    """Add the gateway's commands (``up``, ``model``, ``traffic``, ``audit``, ``rollout``,
    ``planner``, ``admin``, ``billing``, ``version``) to ``tandem``'s subparsers."""
    up = commands.add_parser("up", help="run the whole stack: workers and gateway")
    up.add_argument("--model", type=Path, help="GGUF file or HF folder (default: bundled SmolLM2)")
    up.add_argument("--served-model-name", help="model name clients send")
    up.add_argument(
        "--config",
        type=Path,
        help="TOML/YAML file declaring several versions, their workers and traffic policies",
    )
    up.add_argument("--cache-dir", type=Path, help="where prepared models are kept")
    up.add_argument("--host", help="gateway address (default 127.0.0.1)")
    up.add_argument("--port", type=int, help="gateway port (default 8000)")
    up.add_argument("--prefill-workers", type=int, dest="num_prefill_workers")
    up.add_argument("--decode-workers", type=int, dest="num_decode_workers")
    up.add_argument(
        "--prefill-url",
        action="append",
        dest="prefill_urls",
        metavar="URL",
        help="a prefill worker someone else runs: http(s)://host[:port][/path-prefix] (repeatable)",
    )
    up.add_argument(
        "--decode-url",
        action="append",
        dest="decode_urls",
        metavar="URL",
        help="a decode worker someone else runs: http(s)://host[:port][/path-prefix] (repeatable)",
    )
    up.add_argument(
        "--gateway-workers",
        type=int,
        dest="gateway_workers",
        metavar="N",
        help="gateway processes serving the one port (default: the cores available minus those "
        "the managed workers are bound to, at least 1; 1 with TANDEM_PLANNER on); above 1 they "
        "share quotas, fairness, idempotency and versions through Redis: TANDEM_REDIS_URL, else "
        "a redis-server tandem up starts (its data in the state dir)",
    )
    up.add_argument("--max-model-len", type=int)
    up.add_argument(
        "--enforce-eager",
        action="store_true",
        default=None,
        help="skip graph compilation: faster boot, slower decode",
    )
    add_log_level_flag(up, default="info")

    model = commands.add_parser("model", help="model versions: prepare, register, deploy")
    add_connection_flags(model)
    model_commands = model.add_subparsers(dest="model_command")
    prepare = model_commands.add_parser("prepare", help="make a vLLM-loadable model folder")
    prepare.add_argument("--model", type=Path, help="GGUF file or HF folder (default: bundled)")
    prepare.add_argument("--cache-dir", type=Path)
    add_log_level_flag(prepare)
    add_model_commands(model_commands)
    add_traffic_parsers(commands)
    add_rollout_parser(commands)
    add_planner_parser(commands)

    add_admin_parser(commands)
    add_billing_parser(commands)
    commands.add_parser("version", help="print the version")


def _settings_from_args(args: argparse.Namespace) -> TandemSettings:
    # Flags win over TANDEM_* environment variables; unset flags leave them alone.
    overrides = {
        key: value
        for key, value in vars(args).items()
        if value is not None and key in TandemSettings.model_fields
    }
    return TandemSettings(**overrides)


async def _up(settings: TandemSettings, log_level: str = "info") -> int:
    stopping = asyncio.Event()
    main_task = asyncio.current_task()
    server: Server | None = None
    processes: GatewayProcesses | None = None

    def on_signal() -> None:
        # First signal: stop gracefully (cancel a boot in progress, or drain the server).
        stopping.set()
        if processes is not None:
            processes.signal_stop()  # they drain while this one does
        if server is not None:
            server.should_exit = True
        elif main_task is not None:
            main_task.cancel()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)

    if not port_is_free(settings.host, settings.port):
        console.print(
            f"[red]{settings.host}:{settings.port} is in use[/]: stop what runs there or pick "
            "another port with --port / TANDEM_PORT"
        )
        return 1
    stack: Stack | None = None
    redis: OwnedRedis | None = None
    try:
        stack = await _plan_stack(settings)
        stack.num_processes = _num_gateway_processes(settings, stack)
        if stack.num_processes > 1:
            settings, redis = await _shared_stores(settings, stack)
        with _boot_display(stack) as on_progress:
            await stack.start(on_progress=on_progress)
        console.print(
            "[green]workers ready[/]: "
            + ", ".join(
                f"{w.name} {w.base_url} ({d.version})" for d in stack.deployments for w in d.workers
            )
        )
        app: Any = stack.app()
        sockets: list[socket.socket] | None = None
        if stack.num_processes > 1:
            adopt_orphan_spools(settings.state_dir, stack.num_processes)
            sockets = [_shared_socket(settings), own_socket(settings, 0)]
            primary_own = sockets[1]
            processes = GatewayProcesses(
                handoffs(stack, settings),
                [
                    (_shared_socket(settings), own_socket(settings, i))
                    for i in range(1, stack.num_processes)
                ],
                log_level,
                # A restarted process has a new pid: the published list follows it.
                on_relaunch=lambda relaunched: write_process_list(
                    settings.state_dir / "gateway-processes.json",
                    _process_list(relaunched, primary_own),
                ),
                cover=_cover_by(lambda: server),
            )
        server = Server(
            uvicorn.Config(
                app,
                host=settings.host,
                port=settings.port,
                log_level=log_level,
                http=limited_httptools(request_limits(settings)),
                lifespan="on",
                timeout_graceful_shutdown=settings.shutdown_grace_s,
                access_log=settings.access_log,
                proxy_headers=False,  # clients are resolved by gateway/client_address.py alone
                headers=process_headers(0) if processes is not None else None,
            )
        )
        _print_up(settings, stack)
        if stopping.is_set():
            return 0
        tune_garbage_collector()
        if processes is None or sockets is None:
            await server.serve()
            return 0
        starter = asyncio.create_task(
            _start_processes(server, processes, settings, sockets[1]), name="gateway-processes"
        )
        try:
            await server.serve(sockets=sockets)
        finally:
            starter.cancel()
            for sock in sockets:
                sock.close()
        return 0 if starter.cancelled() or starter.result() else 1
    except WorkerStartupError as exc:
        console.print(f"[red]a worker failed to start:[/]\n{exc}")
        return 1
    except (
        ConfigFileError,
        VersionSourceError,
        TelemetryConfigError,
        RedisServerError,
        GatewayProcessError,
    ) as exc:
        console.print(f"[red]cannot start:[/] {exc}")
        return 1
    except ProfileError as exc:
        console.print(
            f"[red]cannot start the planner (TANDEM_PLANNER={settings.planner}):[/] {exc}; "
            "or point TANDEM_PLANNER_PROFILE at a profile, or set TANDEM_PLANNER=off",
            markup=True,
            highlight=False,
        )
        return 1
    except asyncio.CancelledError:
        console.print("stopping before the stack was up")
        return 130
    finally:
        # In order: the other gateway processes (they use the workers and Redis), the
        # workers, then Redis.
        if processes is not None:
            with _status_line("stopping the other gateway processes"):
                # Each drains its requests for up to the grace period, as this one did.
                await processes.aclose(settings.shutdown_grace_s + STOP_TIMEOUT_S)
        if stack is not None:
            with _status_line("stopping workers"):
                await stack.aclose()
            console.print("all workers stopped")
        if redis is not None:
            await redis.aclose()


def _num_gateway_processes(settings: TandemSettings, stack: Stack) -> int:
    """``--gateway-workers``, else the cores left over by the managed workers' bindings (1
    with the planner on: it sees one process's load)."""
    if settings.gateway_workers is not None:
        return settings.gateway_workers
    if settings.planner != "off":
        return 1
    num_managed = sum(
        1 for pool in stack.supervisor.pools() for status in pool.status() if status.managed
    )
    return default_gateway_workers(os.sched_getaffinity(0), settings.cpu_binding, num_managed)


async def _shared_stores(
    settings: TandemSettings, stack: Stack
) -> tuple[TandemSettings, OwnedRedis | None]:
    """The settings every process runs with: Redis for every shared store (the one given, or
    one started here). Refuses what one process's view cannot do for all of them."""
    if settings.planner != "off":
        raise GatewayProcessError(
            f"TANDEM_PLANNER={settings.planner} reads the load one gateway process sees, and "
            f"{stack.num_processes} would share it: run --gateway-workers 1 with the planner, "
            "or TANDEM_PLANNER=off"
        )
    redis = None
    if settings.redis_url is None:
        redis = OwnedRedis(settings.state_dir / "redis")
        try:
            await redis.start()
        except BaseException:
            await redis.aclose()
            raise
        console.print(f"redis-server for {stack.num_processes} gateway processes: {redis.url}")
        settings = settings.model_copy(update={"redis_url": redis.url})
        stack.settings = settings
    return settings, redis


def _process_list(
    processes: GatewayProcesses, own: socket.socket
) -> list[tuple[int, int | None, str]]:
    """Each gateway process's (index, pid, own address), this one first."""
    entries: list[tuple[int, int | None, str]] = [
        (0, os.getpid(), f"http://127.0.0.1:{own.getsockname()[1]}")
    ]
    return entries + [
        (i, pid, url)
        for i, (pid, url) in enumerate(zip(processes.pids, processes.urls, strict=True), 1)
    ]


def _cover_by(server: Callable[[], Server | None]) -> Cover:
    """A dead gateway process's socket served by this process's server (``server()``, which
    runs by the time any process can die: they start once it serves)."""

    async def cover(sock: socket.socket) -> asyncio.Server:
        serving = server()
        assert serving is not None
        return await serving.cover(sock)

    return cover


def _shared_socket(settings: TandemSettings) -> socket.socket:
    return listening_socket(settings.host, settings.port, reuse_port=True)


async def _start_processes(
    server: Server, processes: GatewayProcesses, settings: TandemSettings, own: socket.socket
) -> bool:
    """Processes 1..N-1, once this one serves (it recorded versions and policies first);
    False, and the server stopped, when one cannot start."""
    while not server.started:  # noqa: ASYNC110 (uvicorn offers a flag, not an event)
        await asyncio.sleep(0.05)
    try:
        await processes.start()
    except GatewayProcessError as exc:
        console.print(f"[red]cannot start:[/] {exc}")
        server.should_exit = True
        return False
    path = settings.state_dir / "gateway-processes.json"
    entries = _process_list(processes, own)
    write_process_list(path, entries)
    console.print(
        f"{len(entries)} gateway processes on {settings.host}:{settings.port}; each alone "
        f"(its /metrics) at {', '.join(url for _, _, url in entries)} (listed in {path})"
    )
    return True


def _print_up(settings: TandemSettings, stack: Stack) -> None:
    base = f"http://{settings.host}:{settings.port}/v1"
    key_hint = (
        "api_key: any string (TANDEM_AUTH_REQUIRED=false)"
        if not settings.auth_required
        else "api_key: a tenant key from `tandem admin tenants create NAME` then "
        "`tandem admin keys issue NAME`"
    )
    console.print(
        f"\n[bold]Tandem is up.[/] Point an OpenAI client at [bold]{base}[/] ({key_hint}), "
        f"model [bold]{', '.join(stack.deployments.aliases())}[/]. Ctrl-C stops "
        "everything.\n"
    )


async def _plan_stack(settings: TandemSettings) -> Stack:
    """The stack's versions, prepared and fingerprinted (in threads: conversion runs in a
    child process), from the configuration file or the one-version settings. The planner's
    profile is read first: a missing one stops ``tandem up`` before any model is prepared."""
    planner = planner_config(settings)
    if settings.config is not None:
        stack_file = load_stack_file(settings.config)
        versions = []
        for entry in stack_file.versions:  # one at a time: conversions share the cache's lock
            versions.append(
                await asyncio.to_thread(
                    fingerprint,
                    settings,
                    entry.source_path,
                    entry.alias,
                    dtype=entry.dtype,
                    defaults=entry.generation_defaults,
                    engine_args=tuple(entry.engine_args),
                    note=entry.note,
                )
            )
        return Stack.from_file(settings, stack_file, versions, settings.config, planner)
    needs_model = settings.num_prefill_workers + settings.num_decode_workers > 0
    version = (
        await asyncio.to_thread(fingerprint, settings, settings.model, None)
        if needs_model
        else None
    )
    return Stack.from_settings(settings, version, planner)


@contextlib.contextmanager
def _status_line(text: str) -> Iterator[Status]:
    if not console.is_terminal:
        console.print(text)  # a spinner draws nothing in a file: say it once instead
    with console.status(text) as status:
        yield status


@contextlib.contextmanager
def _boot_display(stack: Stack) -> Iterator[Callable[[str], None]]:
    """The ``on_progress`` of a boot: a spinner line on a terminal, else plain lines."""
    if console.is_terminal:
        with _status_line("booting workers") as status:
            yield lambda line: status.update(f"booting workers: {line}")
        return
    progress = BootProgress(console)
    # Each pool's line arrives about every second: a tick to look at every worker's status.
    yield lambda _line: progress.update(
        [status for pool in stack.supervisor.pools() for status in pool.status()]
    )


class BootProgress:
    """Plain-text boot progress for a console that is not a terminal (``> log``, CI).

    Says when each worker starts, how long it has been starting every ``interval_s``, and how
    long it took once ready: ``prefill-0: starting (20 s)``, ``prefill-0: ready in 93 s``.
    """

    def __init__(
        self,
        console: Console,
        interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._console = console
        self._interval_s = interval_s
        self._clock = clock
        self._started_at = clock()  # workers are launched right after: their boot starts here
        self._next_line_at: dict[str, float] = {}
        self._ready: set[str] = set()

    def update(self, statuses: Sequence[WorkerStatus]) -> None:
        """Print what changed or is due since the last call; call it about every second."""
        now = self._clock()
        elapsed = f"{now - self._started_at:.0f} s"
        for status in statuses:
            if status.name in self._ready:
                continue
            waiting = "starting" if status.managed else f"waiting for {status.base_url}"
            if status.healthy:
                self._ready.add(status.name)
                self._say(f"{status.name}: ready in {elapsed}")
            elif status.name not in self._next_line_at:
                self._next_line_at[status.name] = now + self._interval_s
                self._say(f"{status.name}: {waiting}")
            elif now >= self._next_line_at[status.name]:
                # Counted from now, not from the missed due time: a late tick prints one line.
                self._next_line_at[status.name] = now + self._interval_s
                self._say(f"{status.name}: {waiting} ({elapsed})")

    def _say(self, line: str) -> None:
        self._console.print(line, markup=False, highlight=False)
