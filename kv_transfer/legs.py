"""The two-leg protocol of vLLM's disaggregated serving, as request-body transformations.

Leg 1 asks a prefill worker to compute the prompt's KV, emit one token and keep the blocks for a
remote decode. Its response carries a transfer handle (``kv_transfer_params``) that leg 2 hands,
unchanged, to a decode worker, which then pulls the blocks over NIXL instead of recomputing them.
"""

from __future__ import annotations

from typing import Any

from kv_transfer.handle import TransferHandle

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


def colocated_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request for one worker doing both phases. A client cannot smuggle in
    ``kv_transfer_params``: they would point a worker at KV blocks of another request."""
    return {k: v for k, v in body.items() if k != "kv_transfer_params"}


def decode_leg_body(body: dict[str, Any], handle: TransferHandle) -> dict[str, Any]:
    """Leg 2: the client's request plus the prefill worker's transfer parameters, unchanged."""
    leg = dict(body)
    leg["kv_transfer_params"] = dict(handle.params)
    return leg
