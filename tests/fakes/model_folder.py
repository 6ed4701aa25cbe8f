"""A tiny model folder with what fingerprinting reads (config, weights, tokenizer, chat
template), and a registered-looking version of it: for tests that plan workers without vLLM."""

from __future__ import annotations

import json
import time
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers

from core.models import GenerationDefaults
from versions.manifest import manifest_for
from versions.records import ModelVersion


def fake_model_folder(path: Path, weights: bytes = b"weights") -> Path:
    """``path`` holding a SmolLM2-shaped config, ``weights`` as its safetensors, a tokenizer."""
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "max_position_embeddings": 2048,
        "num_hidden_layers": 2,
        "num_attention_heads": 3,
        "num_key_value_heads": 3,
        "hidden_size": 96,
    }
    (path / "config.json").write_text(json.dumps(config))
    (path / "model.safetensors").write_bytes(weights)
    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # a token a word
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    return path


def fake_version(
    path: Path,
    alias: str = "smol",
    *,
    weights: bytes = b"weights",
    defaults: GenerationDefaults | None = None,
    engine_args: tuple[str, ...] = (),
) -> ModelVersion:
    """A version of ``alias`` over a fake folder at ``path``."""
    folder = fake_model_folder(path, weights)
    manifest = manifest_for(
        folder,
        dtype="float32",
        max_model_len=2048,
        engine_args=engine_args,
        defaults=defaults or GenerationDefaults(),
    )
    return ModelVersion.new(
        alias, manifest, source=str(folder), model_dir=str(folder), created_at=time.time(),
        created_by="test",
    )  # fmt: skip
