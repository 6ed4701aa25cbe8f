"""The transfer handle: where a prefill worker keeps one request's KV for a decode worker.

Parsed from the ``kv_transfer_params`` of a leg-1 response (vLLM's NixlConnector fills them in
``request_finished``). The parsed fields are for routing, logs and metrics; the decode worker
gets the worker's own parameters, unchanged, since vLLM may add fields Tandem does not know.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from core.errors import EngineError


@dataclass(frozen=True, slots=True)
class TransferHandle:
    """One request's KV, held on a prefill worker under a lease."""

    engine_id: str
    """The prefill engine (``remote_engine_id``)."""
    host: str
    """Where its NIXL side channel listens (``remote_host``)."""
    port: int
    """Its side-channel port (``remote_port``)."""
    block_ids: tuple[tuple[int, ...], ...]
    """KV block ids, one tuple per KV-cache group (older vLLM sends one flat list)."""
    num_tokens: int | None
    """Prompt tokens whose KV is held (``remote_num_tokens``), when reported."""
    expires_at: float
    """``time.monotonic()`` after which the prefill worker may have freed the blocks (its KV
    lease, counted from when the leg-1 answer arrived); the decode worker renews the lease
    once it starts reading."""
    params: Mapping[str, Any]
    """The worker's ``kv_transfer_params`` as received: what leg 2 carries."""

    @property
    def num_blocks(self) -> int:
        return sum(len(group) for group in self.block_ids)

    def expired(self) -> bool:
        return time.monotonic() >= self.expires_at

    @classmethod
    def from_prefill_response(
        cls, response: Mapping[str, Any], worker_name: str, *, lease_s: float
    ) -> TransferHandle:
        """Check and parse a leg-1 response that just arrived from a worker holding KV for
        ``lease_s``, or raise ``EngineError`` naming what is wrong.

        Forwarding a malformed handle would make the decode worker fail later, with a far less
        helpful message; an ``EngineError`` here lets the gateway fall back instead.
        """
        params = response.get("kv_transfer_params")
        if not isinstance(params, Mapping):
            raise EngineError(
                f"prefill worker {worker_name} returned no kv_transfer_params; "
                "is it running with kv_role=kv_producer?"
            )
        missing = [
            key
            for key in ("remote_engine_id", "remote_block_ids", "remote_host", "remote_port")
            if params.get(key) is None
        ]
        if missing:
            raise EngineError(
                f"prefill worker {worker_name} returned kv_transfer_params without "
                f"{', '.join(missing)}"
            )
        try:
            return cls(
                engine_id=str(params["remote_engine_id"]),
                host=str(params["remote_host"]),
                port=int(params["remote_port"]),
                block_ids=_block_groups(params["remote_block_ids"]),
                num_tokens=_optional_int(params.get("remote_num_tokens")),
                expires_at=time.monotonic() + lease_s,
                params=dict(params),
            )
        except (TypeError, ValueError) as exc:
            raise EngineError(
                f"prefill worker {worker_name} returned malformed kv_transfer_params: {exc}"
            ) from exc


def _block_groups(value: object) -> tuple[tuple[int, ...], ...]:
    if not isinstance(value, list):
        raise TypeError(f"remote_block_ids must be a list, got {type(value).__name__}")
    if all(isinstance(item, list) for item in value):
        return tuple(tuple(_block_id(block) for block in group) for group in value)
    return (tuple(_block_id(block) for block in value),)


def _block_id(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"block ids must be integers, got {value!r}")
    return value


def _optional_int(value: object) -> int | None:
    return None if value is None else int(value)  # type: ignore[call-overload]
