"""The two-leg protocol of vLLM's disaggregated serving, as request-body transformations.

Leg 1 asks a prefill worker to compute the prompt's KV, emit one token and keep the blocks for a
remote decode. Its response carries a transfer handle (``kv_transfer_params``) that leg 2 hands,
unchanged, to a decode worker, which then pulls the blocks over NIXL instead of recomputing them.
"""

from __future__ import annotations

from typing import Any

from core.errors import EngineError

# Fields vLLM's prefill worker must return for the decode worker to find the KV blocks.
_REQUIRED_HANDLE_KEYS = ("remote_engine_id", "remote_block_ids", "remote_host", "remote_port")

# Not supported or meaningless on the one-token prefill leg; leg 2 keeps them.
_LEG1_DROPPED_FIELDS = ("stream_options", "min_tokens")


def prefill_leg_body(body: dict[str, Any]) -> dict[str, Any]:
    """Leg 1: the client's request, one token, not streamed, KV kept for a remote decode."""
    leg = {k: v for k, v in body.items() if k not in _LEG1_DROPPED_FIELDS}
    leg["stream"] = False
    leg["max_tokens"] = 1
    if "max_completion_tokens" in leg:
        leg["max_completion_tokens"] = 1
    leg["n"] = 1
    leg["kv_transfer_params"] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    return leg


def transfer_handle(prefill_response: dict[str, Any], worker_name: str) -> dict[str, Any]:
    """The ``kv_transfer_params`` of a leg-1 response, checked before it goes to a decode worker.

    Raises ``EngineError`` if the prefill worker answered without a usable handle (wrong
    connector configuration, or a worker that is not a KV producer): forwarding junk would make
    the decode worker fail later with a far less helpful message.
    """
    params = prefill_response.get("kv_transfer_params")
    if not isinstance(params, dict):
        raise EngineError(
            f"prefill worker {worker_name} returned no kv_transfer_params; "
            "is it running with kv_role=kv_producer?"
        )
    missing = [key for key in _REQUIRED_HANDLE_KEYS if params.get(key) is None]
    if missing:
        raise EngineError(
            f"prefill worker {worker_name} returned kv_transfer_params without {', '.join(missing)}"
        )
    return params


def colocated_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request for one worker doing both phases. A client cannot smuggle in
    ``kv_transfer_params``: they would point a worker at KV blocks of another request."""
    return {k: v for k, v in body.items() if k != "kv_transfer_params"}


def decode_leg_body(body: dict[str, Any], handle: dict[str, Any]) -> dict[str, Any]:
    """Leg 2: the client's request plus the transfer handle from leg 1."""
    leg = dict(body)
    leg["kv_transfer_params"] = handle
    return leg
