from __future__ import annotations

import pytest

from core.errors import EngineError
from core.messages import WorkerRole
from kv_transfer.connector import ConnectorConfig, KvBufferDevice, kv_transfer_config
from kv_transfer.legs import colocated_body, decode_leg_body, prefill_leg_body, transfer_handle

HANDLE = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_engine_id": "e1",
    "remote_block_ids": [[1, 2]],
    "remote_host": "localhost",
    "remote_port": 5600,
    "remote_request_id": "r-1",
}


def test_prefill_leg_asks_for_one_unstreamed_token_and_keeps_kv() -> None:
    body = {
        "model": "m",
        "messages": [],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_completion_tokens": 50,
        "min_tokens": 3,
        "n": 1,
        "temperature": 0.5,
    }
    leg = prefill_leg_body(body)
    assert leg["stream"] is False and leg["max_tokens"] == 1 and leg["max_completion_tokens"] == 1
    assert "stream_options" not in leg and "min_tokens" not in leg
    assert leg["kv_transfer_params"]["do_remote_decode"] is True
    assert leg["temperature"] == 0.5
    assert body["stream"] is True and "kv_transfer_params" not in body, "input left untouched"


def test_decode_leg_carries_the_handle_and_the_original_request() -> None:
    body = {"model": "m", "min_tokens": 3, "stream": True}
    leg = decode_leg_body(body, HANDLE)
    assert leg["kv_transfer_params"] is HANDLE
    assert leg["min_tokens"] == 3 and leg["stream"] is True


def test_colocated_body_drops_client_supplied_kv_params() -> None:
    body = {"model": "m", "kv_transfer_params": {"do_remote_prefill": True}, "top_k": 2}
    assert colocated_body(body) == {"model": "m", "top_k": 2}


def test_handle_is_checked_before_it_is_forwarded() -> None:
    assert transfer_handle({"kv_transfer_params": HANDLE}, "p0") is HANDLE
    with pytest.raises(EngineError, match="kv_producer"):
        transfer_handle({"kv_transfer_params": None}, "p0")
    with pytest.raises(EngineError, match="remote_block_ids"):
        transfer_handle({"kv_transfer_params": {**HANDLE, "remote_block_ids": None}}, "p0")


def test_connector_config_per_role() -> None:
    cpu = ConnectorConfig()
    assert kv_transfer_config(WorkerRole.PREFILL, cpu) == {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_producer",
        "kv_buffer_device": "cpu",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"kv_lease_duration": 10},
    }
    gpu = ConnectorConfig(buffer_device=KvBufferDevice.CUDA)
    assert kv_transfer_config(WorkerRole.DECODE, gpu)["kv_role"] == "kv_consumer"
    assert kv_transfer_config(WorkerRole.DECODE, gpu)["kv_buffer_device"] == "cuda"
