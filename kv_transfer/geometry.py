"""How many bytes of KV one block holds, so each transfer handle can be priced in bytes.

vLLM reports NIXL bytes only as a per-worker histogram; it does not say which request moved
what. A handle names the request's blocks, and a block of a standard attention model holds
``block_size`` tokens of K and V for every layer: that product is what a decode worker reads for
the request (less when it already holds a prefix of the prompt in its own cache).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_DTYPE_BYTES = {
    "float32": 4, "float": 4, "fp32": 4,
    "bfloat16": 2, "float16": 2, "half": 2, "fp16": 2, "bf16": 2,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1,
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class KvGeometry:
    """The shape of one token's KV on a worker."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    block_size: int
    """Tokens per KV block (vLLM's ``--block-size``)."""

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def bytes_of(self, num_blocks: int) -> int:
        return num_blocks * self.bytes_per_block

    @classmethod
    def from_hf_config(
        cls, config: Mapping[str, Any], *, dtype: str, block_size: int
    ) -> KvGeometry | None:
        """The geometry of a Hugging Face ``config.json``; None where KV is not one K and one V
        per KV head and layer (MLA, hybrid or sliding-window models), so no figure is guessed.

        ``dtype`` is the workers' ``--dtype``; ``auto`` takes the checkpoint's.
        """
        layer_types = config.get("layer_types") or ()
        if (
            "kv_lora_rank" in config
            or "sliding_window_pattern" in config
            or any(kind != "full_attention" for kind in layer_types)
        ):
            return None
        try:
            num_heads = int(config["num_attention_heads"])
            head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // num_heads)
            num_kv_heads = int(config.get("num_key_value_heads") or num_heads)
            num_layers = int(config["num_hidden_layers"])
        except (KeyError, TypeError, ValueError):
            return None
        if dtype == "auto":
            dtype = str(config.get("dtype") or config.get("torch_dtype") or "")
        dtype_bytes = _DTYPE_BYTES.get(dtype)
        if dtype_bytes is None:
            return None
        return cls(num_layers, num_kv_heads, head_dim, dtype_bytes, block_size)

    @classmethod
    def of_model_dir(cls, path: Path, *, dtype: str, block_size: int) -> KvGeometry | None:
        """The geometry of a prepared model folder; None without a readable ``config.json``."""
        try:
            config = json.loads((path / "config.json").read_text())
        except (OSError, ValueError):
            return None
        return cls.from_hf_config(config, dtype=dtype, block_size=block_size)
