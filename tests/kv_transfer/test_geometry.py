"""KV bytes per block from a model's config: what each transfer handle is worth in bytes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kv_transfer.geometry import KvGeometry

# SmolLM2-135M-Instruct's config.json (the bundled model), trimmed to what matters here.
SMOLLM2 = {
    "architectures": ["LlamaForCausalLM"],
    "dtype": "bfloat16",
    "head_dim": 64,
    "hidden_size": 576,
    "num_attention_heads": 9,
    "num_hidden_layers": 30,
    "num_key_value_heads": 3,
}


def test_the_bundled_model_in_float32_holds_46080_bytes_per_token() -> None:
    geometry = KvGeometry.from_hf_config(SMOLLM2, dtype="float32", block_size=128)
    assert geometry is not None
    # K and V x 30 layers x 3 KV heads x 64 dims x 4 bytes. The decode worker's NIXL counter
    # read 17.7 MB for a 290-token prompt: 3 blocks of 128 tokens = 17,694,720 bytes.
    assert geometry.bytes_per_token == 46_080
    assert geometry.bytes_of(3) == 17_694_720


def test_auto_takes_the_checkpoint_dtype() -> None:
    geometry = KvGeometry.from_hf_config(SMOLLM2, dtype="auto", block_size=16)
    assert geometry is not None
    assert geometry.dtype_bytes == 2 and geometry.bytes_per_block == 23_040 * 16


def test_head_dim_defaults_to_hidden_size_over_heads() -> None:
    config = {k: v for k, v in SMOLLM2.items() if k != "head_dim"}
    geometry = KvGeometry.from_hf_config(config, dtype="float16", block_size=16)
    assert geometry is not None and geometry.head_dim == 64


@pytest.mark.parametrize(
    "change",
    [
        {"kv_lora_rank": 512},  # MLA: one latent per token, not K and V per head
        {"layer_types": ["full_attention", "sliding_attention"]},
        {"sliding_window_pattern": 6},
        {"num_hidden_layers": None},
        {"dtype": "int4"},
    ],
)
def test_no_figure_is_guessed_for_other_shapes(change: dict[str, Any]) -> None:
    assert KvGeometry.from_hf_config({**SMOLLM2, **change}, dtype="auto", block_size=16) is None


def test_full_attention_layer_types_are_fine() -> None:
    config = {**SMOLLM2, "layer_types": ["full_attention"] * 30}
    assert KvGeometry.from_hf_config(config, dtype="float32", block_size=128) is not None


def test_of_model_dir(tmp_path: Path) -> None:
    assert KvGeometry.of_model_dir(tmp_path, dtype="float32", block_size=128) is None
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2))
    geometry = KvGeometry.of_model_dir(tmp_path, dtype="float32", block_size=128)
    assert geometry is not None and geometry.bytes_per_block == 46_080 * 128
