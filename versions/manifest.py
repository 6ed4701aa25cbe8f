"""A version's manifest read off a prepared model folder: digests of its files, no torch.

Digests (sha256, hex):

- weights: a folder converted from a GGUF carries ``tandem-model.json`` (written last by
  ``workers.model``), whose ``source_sha256`` is the GGUF's digest: the whole model, read once at
  conversion. Otherwise the weight files (``*.safetensors``, ``pytorch_model*.bin``) together
  with ``config.json`` and ``generation_config.json``: the config decides what the weights
  compute (RoPE scaling, layer shapes) and vLLM takes its default sampling parameters from the
  generation config, so a change to either is a new version. Each file counts as
  ``name \\0 sha256(file)``, in name order.
- tokenizer: ``tokenizer.json``, ``tokenizer.model``, ``tokenizer_config.json`` (those present),
  the last without its ``chat_template`` key and re-serialised canonically.
- chat template: ``chat_template.jinja``, else ``tokenizer_config.json``'s ``chat_template``
  (a string, or a list of named templates as canonical JSON), else none.

Reading a large model's weights takes seconds: call ``manifest_for`` in a thread.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from core.models import GenerationDefaults
from versions.records import VersionManifest, VersionSourceError
from workers.model import remembered_digest

CONVERTED_MANIFEST = "tandem-model.json"
"""Written by ``workers.model`` into a folder converted from a GGUF."""
WEIGHT_GLOBS = ("*.safetensors", "pytorch_model*.bin")
CONFIG_FILES = ("config.json", "generation_config.json")
"""Hashed with the weights: ``config.json`` must exist, ``generation_config.json`` may."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
CHAT_TEMPLATE_FILE = "chat_template.jinja"

OUTPUT_AFFECTING_FLAGS = frozenset(
    {
        "--quantization",
        "--kv-cache-dtype",
        "--rope-scaling",
        "--rope-theta",
        "--tokenizer-mode",
        "--seed",
        "--generation-config",
        "--override-generation-config",
        "--max-logprobs",
        "--hf-overrides",
        "--revision",
        "--code-revision",
        "--tokenizer-revision",
    }
)
"""vLLM flags known to change what a model outputs (each takes a value). Others (parallelism,
memory, scheduling, ``--enforce-eager``...) change speed, not outputs, and are not part of a
version; a flag not listed here is dropped, so a new output-affecting one must be added."""
_SHORT_FLAGS = {"-q": "--quantization"}

_CHUNK_BYTES = 1 << 20
_NO_DEFAULTS = GenerationDefaults()
_FIX = (
    "point at a Hugging Face model folder (config.json, weights, tokenizer) "
    "or one `tandem model prepare` made"
)


def manifest_for(
    model_dir: Path,
    *,
    dtype: str,
    max_model_len: int,
    engine_args: Sequence[str] = (),
    defaults: GenerationDefaults = _NO_DEFAULTS,
) -> VersionManifest:
    """The manifest of the model in ``model_dir`` served with these settings.

    ``VersionSourceError`` naming the file when one the model needs is missing or unreadable;
    ``ValueError`` for a bad setting (empty dtype, a context window under 1, a flag without
    its value). Blocking (reads every weight file): call it in a thread."""
    if not dtype:
        raise ValueError("dtype: a vLLM dtype such as bfloat16, float16 or auto")
    if isinstance(max_model_len, bool) or max_model_len < 1:
        raise ValueError("max_model_len: a whole number of tokens, at least 1")
    if not model_dir.is_dir():
        raise VersionSourceError(f"model folder {model_dir} does not exist: {_FIX}")
    tokenizer_config = _tokenizer_config(model_dir)
    return VersionManifest(
        weights_sha256=_weights_digest(model_dir),
        tokenizer_sha256=_tokenizer_digest(model_dir, tokenizer_config),
        chat_template_sha256=_template_digest(model_dir, tokenizer_config),
        dtype=dtype,
        max_model_len=max_model_len,
        engine_args=output_affecting_args(engine_args),
        defaults=defaults,
    )


def output_affecting_args(args: Sequence[str]) -> tuple[str, ...]:
    """The output-affecting flags among vLLM command-line ``args`` (see
    ``OUTPUT_AFFECTING_FLAGS``) as ``--flag=value``, sorted; a flag given twice counts once,
    with its last value (as vLLM's parser takes it). Both ``--flag value`` and ``--flag=value``
    are read, and ``--flag_name`` as ``--flag-name`` (vLLM accepts either). ``ValueError`` for
    such a flag without a value."""
    values: dict[str, str] = {}
    tokens = list(args)
    i = 0
    while i < len(tokens):
        flag, eq, value = tokens[i].partition("=")
        flag = _canonical_flag(flag)
        i += 1
        if flag not in OUTPUT_AFFECTING_FLAGS:
            # An unknown flag's value is the next token, no flag of ours: skipped in turn.
            continue
        if not eq:
            if i >= len(tokens) or tokens[i].startswith("--"):
                raise ValueError(f"engine argument {flag} needs a value")
            value = tokens[i]
            i += 1
        values[flag] = value
    return tuple(sorted(f"{flag}={value}" for flag, value in values.items()))


def _canonical_flag(flag: str) -> str:
    if flag in _SHORT_FLAGS:
        return _SHORT_FLAGS[flag]
    if flag.startswith("--"):
        return "--" + flag[2:].replace("_", "-")
    return flag


def _weights_digest(model_dir: Path) -> str:
    converted = model_dir / CONVERTED_MANIFEST
    config = model_dir / "config.json"
    if not config.is_file():
        raise VersionSourceError(f"{config} is missing: {_FIX}")
    if converted.exists():
        data = _read_json(converted)
        digest = data.get("source_sha256")
        if not isinstance(digest, str) or not digest:
            raise VersionSourceError(
                f"{converted} has no source_sha256: prepare the model again "
                "(`tandem model prepare`)"
            )
        return digest
    weights = sorted({p for pattern in WEIGHT_GLOBS for p in model_dir.glob(pattern)})
    if not weights:
        raise VersionSourceError(
            f"{model_dir} has no weights ({' or '.join(WEIGHT_GLOBS)}): {_FIX}"
        )
    configs = [model_dir / name for name in CONFIG_FILES if (model_dir / name).exists()]
    return _digest((p.name, _weights_file_digest(p)) for p in sorted(configs + weights))


def _weights_file_digest(path: Path) -> str:
    """A weight file's digest, remembered by path and stat (``workers.model``): a gateway that
    restarts does not read hundreds of gigabytes again."""
    try:
        return remembered_digest(path)
    except OSError as exc:
        raise VersionSourceError(f"{path} is unreadable ({exc}): {_FIX}") from exc


def _tokenizer_digest(model_dir: Path, tokenizer_config: dict[str, Any] | None) -> str:
    parts: list[tuple[str, str]] = []
    for name in TOKENIZER_FILES:
        path = model_dir / name
        if name == "tokenizer_config.json":
            if tokenizer_config is not None:
                # The template has a digest of its own: a new template is not a new tokenizer.
                rest = {k: v for k, v in tokenizer_config.items() if k != "chat_template"}
                parts.append((name, _sha256(_canonical_json(rest))))
        elif path.exists():
            parts.append((name, _file_digest(path)))
    if not parts:
        raise VersionSourceError(
            f"{model_dir / 'tokenizer.json'} is missing (nor is there "
            f"{' or '.join(TOKENIZER_FILES[1:])}): {_FIX}"
        )
    return _digest(parts)


def _template_digest(model_dir: Path, tokenizer_config: dict[str, Any] | None) -> str | None:
    jinja = model_dir / CHAT_TEMPLATE_FILE
    if jinja.exists():
        return _file_digest(jinja)
    template = None if tokenizer_config is None else tokenizer_config.get("chat_template")
    if isinstance(template, str):
        return _sha256(template.encode())
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}, ...]
        return _sha256(_canonical_json(template))
    return None


def _tokenizer_config(model_dir: Path) -> dict[str, Any] | None:
    path = model_dir / "tokenizer_config.json"
    return _read_json(path) if path.exists() else None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise VersionSourceError(f"{path} is unreadable ({exc}): {_FIX}") from exc
    if not isinstance(data, dict):
        raise VersionSourceError(f"{path} is not a JSON object: {_FIX}")
    return data


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    buffer = memoryview(bytearray(_CHUNK_BYTES))
    try:
        with path.open("rb", buffering=0) as file:
            while count := file.readinto(buffer):
                digest.update(buffer[:count])
    except OSError as exc:
        raise VersionSourceError(f"{path} is unreadable ({exc}): {_FIX}") from exc
    return digest.hexdigest()


def _digest(parts: Iterable[tuple[str, str]]) -> str:
    """One digest over (file name, file digest) pairs, in the order given."""
    digest = hashlib.sha256()
    for name, file_digest in parts:
        digest.update(f"{name}\0{file_digest}".encode())
    return digest.hexdigest()


def _canonical_json(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
