"""One secondary gateway process of ``tandem up --gateway-workers N`` (internal: ``tandem up``
launches it; ``gateway/assembly/gateway_processes.py`` says how).

It reads its ``Handoff`` from standard input, serves the app over the primary's workers (as
external ones, with no planner and no runtime deployments) on the two sockets it inherited,
and stops on SIGTERM or SIGINT as ``tandem up`` does: stop accepting, drain, exit.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys
from collections.abc import Sequence

import uvicorn

from gateway.assembly.gateway_processes import Handoff, process_headers
from gateway.assembly.settings import TandemSettings
from gateway.assembly.stack import Stack, request_limits
from gateway.catalog import DeploymentSpec
from gateway.cli.http_protocol import limited_httptools
from gateway.cli.serve import Server, run_event_loop, tune_garbage_collector
from gateway.planning import PlannerConfig
from versions.records import ModelVersion

log = logging.getLogger("tandem.gateway.processes")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gateway.cli.gateway_process")
    parser.add_argument("--shared-fd", type=int, required=True)
    parser.add_argument("--own-fd", type=int, required=True)
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    handoff = Handoff.from_json(sys.stdin.buffer.read())
    sockets = [socket.socket(fileno=args.shared_fd), socket.socket(fileno=args.own_fd)]
    return run_event_loop(_serve(handoff, sockets, args.log_level))


async def _serve(handoff: Handoff, sockets: list[socket.socket], log_level: str) -> int:
    settings = TandemSettings(**handoff.settings)
    planned = [
        (
            ModelVersion.from_dict(d.version) if d.version is not None else None,
            DeploymentSpec(
                num_prefill=0,
                num_decode=0,
                prefill_urls=d.prefill_urls,
                decode_urls=d.decode_urls,
                served_as=d.served_as,
            ),
        )
        for d in handoff.deployments
    ]
    # Policies and versions were recorded by the primary; this process reads them from Redis.
    stack = Stack.of_versions(settings, planned, {}, PlannerConfig())
    stack.process_index = handoff.index
    stack.num_processes = settings.gateway_workers or 2  # the primary always sets it
    server = Server(
        uvicorn.Config(
            stack.app(),
            log_level=log_level,
            http=limited_httptools(request_limits(settings)),
            lifespan="on",
            timeout_graceful_shutdown=settings.shutdown_grace_s,
            access_log=settings.access_log,
            proxy_headers=False,  # clients are resolved by gateway/client_address.py alone
            headers=process_headers(handoff.index),
        )
    )
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))
    try:
        await stack.start()  # external workers only: health polling, ready at once
        tune_garbage_collector()
        await server.serve(sockets=sockets)
    finally:
        await stack.aclose()
    return 0


if __name__ == "__main__":
    sys.exit(main())
