"""Version manifests read off small fake model folders: the same content is the same id, any
output-affecting change is another. Then the records' codecs and the alias rule."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from core.models import GenerationDefaults
from versions.manifest import manifest_for, output_affecting_args
from versions.records import (
    AuditEntry,
    ModelVersion,
    VersionManifest,
    VersionSourceError,
    check_alias,
)

TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"
# More significant digits than a JSON number of 14 digits keeps: a codec that rounds fails.
PRECISE_TIME = 1732281234.1234567


def make_model(folder: Path, **changes: Any) -> Path:
    """A fake HF model folder; ``changes`` override or (None) remove the files' contents."""
    files: dict[str, Any] = {
        "config.json": json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 64}),
        "model.safetensors": b"\x00weights\x01" * 100,
        "tokenizer.json": json.dumps({"model": {"vocab": {"a": 0, "b": 1}}}),
        "tokenizer_config.json": json.dumps({"eos_token": "</s>", "chat_template": TEMPLATE}),
    }
    files.update(changes)
    folder.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        if content is None:
            continue
        path = folder / name
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
    return folder


def manifest(folder: Path, **settings: Any) -> VersionManifest:
    options: dict[str, Any] = {"dtype": "bfloat16", "max_model_len": 2048}
    options.update(settings)
    return manifest_for(folder, **options)


def test_the_same_content_is_the_same_id_wherever_it_lives(tmp_path: Path) -> None:
    first = manifest(make_model(tmp_path / "a"))
    second = manifest(make_model(tmp_path / "elsewhere" / "b"))
    assert first == second
    assert first.version_id == second.version_id
    assert len(first.version_id) == 16 and int(first.version_id, 16) >= 0
    assert first.chat_template_sha256 is not None


@pytest.mark.parametrize(
    "change",
    [
        {"model.safetensors": b"other weights"},
        {"model-00002-of-00002.safetensors": b"a second shard"},
        {"config.json": json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 65})},
        {"generation_config.json": json.dumps({"temperature": 0.3})},
        {"tokenizer.json": json.dumps({"model": {"vocab": {"a": 0, "c": 1}}})},
        {"tokenizer.model": b"sentencepiece"},
        {"tokenizer_config.json": json.dumps({"eos_token": "<eos>", "chat_template": TEMPLATE})},
        {"tokenizer_config.json": json.dumps({"eos_token": "</s>", "chat_template": "{{ x }}"})},
        {"chat_template.jinja": "{{ messages[0].content }}"},
    ],
    ids=lambda change: next(iter(change)),
)
def test_any_file_change_is_another_id(tmp_path: Path, change: dict[str, Any]) -> None:
    base = manifest(make_model(tmp_path / "base"))
    changed = manifest(make_model(tmp_path / "changed", **change))
    assert changed.version_id != base.version_id


def test_a_new_template_changes_only_the_template_digest(tmp_path: Path) -> None:
    base = manifest(make_model(tmp_path / "base"))
    other = json.dumps({"eos_token": "</s>", "chat_template": "{{ x }}"})
    changed = manifest(make_model(tmp_path / "changed", **{"tokenizer_config.json": other}))
    assert changed.tokenizer_sha256 == base.tokenizer_sha256
    assert changed.weights_sha256 == base.weights_sha256
    assert changed.chat_template_sha256 != base.chat_template_sha256


def test_template_sources_in_order(tmp_path: Path) -> None:
    no_template = json.dumps({"eos_token": "</s>"})
    bare = manifest(make_model(tmp_path / "bare", **{"tokenizer_config.json": no_template}))
    assert bare.chat_template_sha256 is None
    named = json.dumps({"chat_template": [{"name": "default", "template": TEMPLATE}]})
    listed = manifest(make_model(tmp_path / "named", **{"tokenizer_config.json": named}))
    assert listed.chat_template_sha256 not in (None, bare.chat_template_sha256)
    # chat_template.jinja wins over tokenizer_config.json's, as transformers reads them.
    jinja = manifest(make_model(tmp_path / "jinja", **{"chat_template.jinja": "{{ y }}"}))
    jinja_only = manifest(
        make_model(
            tmp_path / "jinja_only",
            **{"chat_template.jinja": "{{ y }}", "tokenizer_config.json": no_template},
        )
    )
    assert jinja.chat_template_sha256 == jinja_only.chat_template_sha256


def test_tokenizer_config_whitespace_does_not_matter(tmp_path: Path) -> None:
    compact = manifest(make_model(tmp_path / "compact"))
    config = {"eos_token": "</s>", "chat_template": TEMPLATE}
    pretty = json.dumps(config, indent=4)
    spaced = manifest(make_model(tmp_path / "pretty", **{"tokenizer_config.json": pretty}))
    assert spaced.version_id == compact.version_id


@pytest.mark.parametrize(
    "settings",
    [
        {"dtype": "float16"},
        {"max_model_len": 4096},
        {"defaults": GenerationDefaults(temperature=0.2)},
        {"defaults": GenerationDefaults(system_prompt="Be brief.")},
        {"engine_args": ["--quantization", "awq"]},
        {"engine_args": ["--seed=1"]},
        {"engine_args": ["--kv-cache-dtype", "fp8"]},
    ],
)
def test_any_setting_change_is_another_id(tmp_path: Path, settings: dict[str, Any]) -> None:
    folder = make_model(tmp_path / "m")
    assert manifest(folder, **settings).version_id != manifest(folder).version_id


def test_speed_only_engine_args_keep_the_id(tmp_path: Path) -> None:
    folder = make_model(tmp_path / "m")
    args = ["--enforce-eager", "--tensor-parallel-size", "2", "--gpu-memory-utilization=0.8"]
    assert manifest(folder, engine_args=args).version_id == manifest(folder).version_id


def test_output_affecting_args_are_normalised_and_sorted() -> None:
    args = [
        "--enforce-eager",
        "--seed",
        "3",
        "-q",
        "awq",
        "--max-num-seqs",
        "8",
        "--kv_cache_dtype=fp8",
        "--rope-theta=10000",
        "--seed=4",  # the last value counts, as vLLM's parser takes it
    ]
    assert output_affecting_args(args) == (
        "--kv-cache-dtype=fp8",
        "--quantization=awq",
        "--rope-theta=10000",
        "--seed=4",
    )
    assert output_affecting_args(["--seed", "1", "--quantization=awq"]) == output_affecting_args(
        ["--quantization", "awq", "--seed=1"]
    )
    for bad in (["--seed"], ["--seed", "--enforce-eager"]):
        with pytest.raises(ValueError, match="--seed needs a value"):
            output_affecting_args(bad)


def test_a_converted_folder_uses_the_gguf_digest(tmp_path: Path) -> None:
    digest = "ab" * 32
    converted = json.dumps({"format_version": 1, "source_sha256": digest, "files": {}})
    first = manifest(make_model(tmp_path / "a", **{"tandem-model.json": converted}))
    assert first.weights_sha256 == digest
    # The GGUF's digest stands for the weights: a re-conversion writing other bytes is the same.
    second = manifest(
        make_model(
            tmp_path / "b", **{"tandem-model.json": converted, "model.safetensors": b"other"}
        )
    )
    assert second.version_id == first.version_id
    broken = json.dumps({"format_version": 1})
    with pytest.raises(VersionSourceError, match=r"tandem-model\.json has no source_sha256"):
        manifest(make_model(tmp_path / "c", **{"tandem-model.json": broken}))


@pytest.mark.parametrize(
    ("missing", "named"),
    [
        ({"tokenizer.json": None, "tokenizer_config.json": None}, "tokenizer.json"),
        ({"config.json": None}, "config.json"),
        ({"model.safetensors": None}, "no weights"),
        ({"tokenizer_config.json": "{not json"}, "tokenizer_config.json"),
    ],
)
def test_missing_or_unreadable_files_are_named(
    tmp_path: Path, missing: dict[str, Any], named: str
) -> None:
    folder = make_model(tmp_path / "m", **missing)
    with pytest.raises(VersionSourceError, match=named) as caught:
        manifest(folder)
    assert str(folder) in str(caught.value)


def test_a_missing_folder_and_bad_settings_are_refused(tmp_path: Path) -> None:
    with pytest.raises(VersionSourceError, match="does not exist"):
        manifest(tmp_path / "nowhere")
    folder = make_model(tmp_path / "m")
    with pytest.raises(ValueError, match="dtype"):
        manifest(folder, dtype="")
    with pytest.raises(ValueError, match="max_model_len"):
        manifest(folder, max_model_len=0)


# --- records -----------------------------------------------------------------------------------


def test_manifest_and_version_round_trip_through_json(tmp_path: Path) -> None:
    defaults = GenerationDefaults(temperature=0.5, max_tokens=64, system_prompt="Hi.")
    made = manifest(make_model(tmp_path / "m"), defaults=defaults, engine_args=["--seed=1"])
    assert VersionManifest.from_dict(json.loads(json.dumps(made.to_dict()))) == made
    version = ModelVersion.new(
        "llama-3.1-8b",
        made,
        source="/models/llama",
        model_dir=str(tmp_path / "m"),
        created_at=PRECISE_TIME,
        created_by="key_1",
        note="first",
    )
    assert version.version_id == made.version_id
    assert version.name == f"llama-3.1-8b@{made.version_id[:8]}"
    data = json.loads(json.dumps(version.to_dict()))
    assert data["name"] == version.name
    assert ModelVersion.from_dict(data) == version


def test_audit_entry_round_trips_through_json() -> None:
    entry = AuditEntry(
        seq=3,
        at=PRECISE_TIME,
        actor="key_1",
        action="policy.set",
        alias="llama",
        subject="llama",
        before=None,
        after={"weights": {"a": 90, "b": 10}},
        reason="canary",
    )
    assert AuditEntry.from_dict(json.loads(json.dumps(entry.to_dict()))) == entry


@pytest.mark.parametrize("alias", ["llama", "a", "llama-3.1_8b", "0x", "a" * 64])
def test_valid_aliases(alias: str) -> None:
    assert check_alias(alias) == alias


@pytest.mark.parametrize("alias", ["", "Llama", "-x", ".x", "a@b", "a b", "a/b", "a" * 65])
def test_invalid_aliases_say_the_rule(alias: str) -> None:
    with pytest.raises(ValueError, match="1 to 64 of a-z"):
        check_alias(alias)


def test_a_version_checks_its_alias_and_id(tmp_path: Path) -> None:
    made = manifest(make_model(tmp_path / "m"))
    good = ModelVersion.new(
        "llama", made, source="s", model_dir="d", created_at=1.0, created_by="config"
    )
    with pytest.raises(ValueError, match="alias"):
        ModelVersion.from_dict({**good.to_dict(), "alias": "Bad@Alias"})
    with pytest.raises(ValueError, match="16 lowercase hex"):
        ModelVersion.from_dict({**good.to_dict(), "version_id": "XYZ"})
