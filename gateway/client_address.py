"""Who is on the other end of a request: the peer's address, or the client a trusted proxy
forwarded (``X-Forwarded-For``). The failed-authentication throttle counts by it
(``gateway/auth_throttle.py``), and ``/metrics`` answers a local one without a key
(``gateway/auth.py``).

``X-Forwarded-For`` is believed only from the proxies an operator names
(``TANDEM_TRUSTED_PROXIES``: addresses or networks): any client can write the header, so
trusting it from anyone would let every request pick its own address. From a trusted peer the
header is read right to left, skipping the trusted proxies; the first address that is not one
of them is the client (the leftmost when all are). The entries to its left were written by
the client itself and are never read. uvicorn's own proxy-header rewriting is off in every
gateway process (``gateway/cli``), so this is the one place that decides.

``ClientAddress`` is an ASGI middleware that puts the resolved address in a context variable
for the request's lifetime; ``current_client()`` reads it where the request is authenticated,
which the route's own call chain reaches without the address passed through every signature.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from contextvars import ContextVar

from starlette.types import ASGIApp, Receive, Scope, Send

Network = ipaddress.IPv4Network | ipaddress.IPv6Network

_client: ContextVar[str | None] = ContextVar("tandem_client_address", default=None)


def current_client() -> str | None:
    """The address of the client whose request runs in this context; None outside a request
    or for a peer without an address (a unix socket)."""
    return _client.get()


def is_local(address: str | None) -> bool:
    """Whether ``address`` is on this host: loopback (``127.0.0.0/8``, ``::1``, IPv4-mapped)."""
    if address is None:
        return False
    try:
        parsed = ipaddress.ip_address(address)
    except ValueError:
        return False
    if isinstance(parsed, ipaddress.IPv6Address) and parsed.ipv4_mapped is not None:
        parsed = parsed.ipv4_mapped
    return parsed.is_loopback


def parse_trusted_proxies(entries: Iterable[str]) -> tuple[Network, ...]:
    """Addresses (``10.0.0.7``) and networks (``10.0.0.0/8``, ``fd00::/8``); ValueError names
    the entry that is neither."""
    networks = []
    for entry in entries:
        try:
            networks.append(ipaddress.ip_network(entry.strip(), strict=False))
        except ValueError as exc:
            raise ValueError(
                f"trusted proxy {entry!r} is not an IP address or network: write e.g. "
                "10.0.0.7 or 10.0.0.0/8"
            ) from exc
    return tuple(networks)


def resolve_client(
    peer: str | None, forwarded_for: Iterable[str], trusted: tuple[Network, ...]
) -> str | None:
    """The client's address: ``peer``, unless it is a trusted proxy; then the rightmost
    ``X-Forwarded-For`` entry that is not one (``forwarded_for``: the header's values in the
    order received, each comma-separated)."""
    if peer is None or not trusted or not _is_trusted(peer, trusted):
        return peer
    hops = [_host(hop) for value in forwarded_for for hop in value.split(",") if hop.strip()]
    client = peer
    for hop in reversed(hops):
        client = hop
        if not _is_trusted(hop, trusted):
            break
    return client


def _host(hop: str) -> str:
    """An entry without the port some proxies append (``1.2.3.4:5678``, ``[2001:db8::1]:80``)."""
    hop = hop.strip()
    if hop.startswith("["):
        return hop[1:].partition("]")[0]
    host, colon, port = hop.partition(":")
    return host if colon and ":" not in port else hop


def _is_trusted(address: str, trusted: tuple[Network, ...]) -> bool:
    try:
        parsed = ipaddress.ip_address(address)
    except ValueError:
        return False  # not an address (a client's own junk): never a proxy of ours
    return any(parsed in network for network in trusted)


class ClientAddress:
    """ASGI middleware: each HTTP request runs with ``current_client()`` set."""

    def __init__(self, app: ASGIApp, trusted_proxies: tuple[str, ...] = ()) -> None:
        self._app = app
        self._trusted = parse_trusted_proxies(trusted_proxies)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        peer: tuple[str, int] | None = scope.get("client")
        forwarded = _forwarded_for(scope) if self._trusted else []
        client = resolve_client(peer[0] if peer else None, forwarded, self._trusted)
        token = _client.set(client)
        try:
            await self._app(scope, receive, send)
        finally:
            _client.reset(token)


def _forwarded_for(scope: Scope) -> list[str]:
    return [
        value.decode("latin-1") for name, value in scope["headers"] if name == b"x-forwarded-for"
    ]
