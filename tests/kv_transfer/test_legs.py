from __future__ import annotations

import time

import pytest

from core.errors import EngineError
from core.messages import WorkerRole
from kv_transfer.connector import ConnectorConfig, KvBufferDevice, kv_transfer_config
from kv_transfer.handle import TransferHandle
from kv_transfer.legs import colocated_body, decode_leg_body, prefill_leg_body

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


def test_decode_leg_carries_the_workers_params_unchanged() -> None:
    body = {"model": "m", "min_tokens": 3, "stream": True}
    extra = {**HANDLE, "tp_size": 1, "transfer_mode": "pull"}  # fields Tandem does not parse
    handle = TransferHandle.from_prefill_response({"kv_transfer_params": extra}, "p0", lease_s=10)
    leg = decode_leg_body(body, handle)
    assert leg["kv_transfer_params"] == extra
    assert leg["min_tokens"] == 3 and leg["stream"] is True


def test_colocated_body_drops_client_supplied_kv_params() -> None:
    body = {"model": "m", "kv_transfer_params": {"do_remote_prefill": True}, "top_k": 2}
    assert colocated_body(body) == {"model": "m", "top_k": 2}


def test_handle_is_parsed() -> None:
    before = time.monotonic()
    handle = TransferHandle.from_prefill_response(
        {"kv_transfer_params": {**HANDLE, "remote_num_tokens": 40}}, "p0", lease_s=10
    )
    assert (handle.engine_id, handle.host, handle.port) == ("e1", "localhost", 5600)
    assert handle.block_ids == ((1, 2),)
    assert handle.num_blocks == 2
    assert handle.num_tokens == 40
    assert before + 10 <= handle.expires_at <= time.monotonic() + 10
    assert not handle.expired()
    flat = TransferHandle.from_prefill_response(
        {"kv_transfer_params": {**HANDLE, "remote_block_ids": [4, 5, 6]}}, "p0", lease_s=10
    )
    assert flat.block_ids == ((4, 5, 6),)


def test_a_handle_past_its_lease_is_expired() -> None:
    handle = TransferHandle.from_prefill_response({"kv_transfer_params": HANDLE}, "p0", lease_s=0)
    assert handle.expired()


@pytest.mark.parametrize(
    ("params", "match"),
    [
        (None, "kv_producer"),
        ({**HANDLE, "remote_block_ids": None}, "remote_block_ids"),
        ({**HANDLE, "remote_port": "not-a-port"}, "malformed"),
        ({**HANDLE, "remote_block_ids": [["x"]]}, "malformed"),
        ({**HANDLE, "remote_block_ids": "1,2"}, "malformed"),
    ],
)
def test_malformed_handles_are_refused(params: object, match: str) -> None:
    with pytest.raises(EngineError, match=match):
        TransferHandle.from_prefill_response({"kv_transfer_params": params}, "p0", lease_s=10)


def test_connector_config_per_role() -> None:
    cpu = ConnectorConfig()
    assert kv_transfer_config(WorkerRole.PREFILL, cpu) == {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_producer",
        "kv_buffer_device": "cpu",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"kv_lease_duration": 10, "backends": ["UCX"]},
    }
    gpu = ConnectorConfig(buffer_device=KvBufferDevice.CUDA)
    assert kv_transfer_config(WorkerRole.DECODE, gpu)["kv_role"] == "kv_consumer"
    assert kv_transfer_config(WorkerRole.DECODE, gpu)["kv_buffer_device"] == "cuda"
