"""``tandem up --config FILE``: several versions, their workers and traffic policies.

TOML (or YAML, same shape). Each ``[[versions]]`` entry is one deployed version; ``label``
names it inside the file (its real name, ``alias@8hex``, is only known once its content is
fingerprinted), and ``[traffic.<alias>]`` refers to versions by label::

    [[versions]]
    label = "baseline"
    alias = "smollm2-135m-instruct"
    source = "bundled"              # or a GGUF file / HF folder
    prefill_workers = 1
    decode_workers = 1

    [[versions]]
    label = "candidate"
    alias = "smollm2-135m-instruct"
    source = "bundled"
    decode_workers = 1
    defaults = { temperature = 0.2, system_prompt = "Answer in one sentence." }

    [traffic.smollm2-135m-instruct]
    split = [{ version = "baseline", weight = 90 }, { version = "candidate", weight = 10 }]
    sticky = true

Other keys of a version: ``dtype``, ``engine_args`` (a list of vLLM flags), ``note``,
``prefill_urls`` / ``decode_urls`` (external workers), ``served_as`` (their model name).
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from core.models import GenerationDefaults
from gateway.catalog import DeploymentSpec, WorkerUrl
from traffic.policy import version_refs, with_versions
from workers.model import BUNDLED_SOURCE


class ConfigFileError(Exception):
    """The configuration file cannot be used; the message names the file and the field."""


class VersionEntry(BaseModel):
    """One ``[[versions]]`` entry."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    label: str = Field(min_length=1)
    """The version's name inside this file (``[traffic]`` refers to it)."""
    alias: str | None = None
    """The ``model`` clients send; default: the name derived from the source."""
    source: str = BUNDLED_SOURCE
    """A GGUF file, an HF folder, or ``bundled``."""
    dtype: str | None = None
    defaults: dict[str, Any] = {}
    engine_args: list[str] = []
    note: str = ""
    prefill_workers: int = Field(0, ge=0)
    decode_workers: int = Field(1, ge=0)
    prefill_urls: list[WorkerUrl] = []
    decode_urls: list[WorkerUrl] = []
    served_as: str | None = None

    @property
    def source_path(self) -> Path | None:
        return None if self.source == BUNDLED_SOURCE else Path(self.source).expanduser()

    @property
    def generation_defaults(self) -> GenerationDefaults:
        return GenerationDefaults.from_dict(self.defaults)

    @property
    def spec(self) -> DeploymentSpec:
        return DeploymentSpec(
            num_prefill=self.prefill_workers,
            num_decode=self.decode_workers,
            prefill_urls=tuple(self.prefill_urls),
            decode_urls=tuple(self.decode_urls),
            served_as=self.served_as,
        )


class StackFile(BaseModel):
    """The whole file."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    versions: list[VersionEntry] = Field(min_length=1)
    traffic: dict[str, dict[str, Any]] = {}
    """Alias -> traffic policy (``traffic/policy.py``'s shape), versions named by label."""


def load_stack_file(path: Path) -> StackFile:
    """The parsed file; ``ConfigFileError`` naming the file and what is wrong."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigFileError(f"cannot read the configuration file {path}: {exc}") from exc
    try:
        if path.suffix.lower() in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = tomllib.loads(text)
    except (tomllib.TOMLDecodeError, ValueError, ImportError) as exc:
        raise ConfigFileError(f"{path} is not valid TOML/YAML: {exc}") from exc
    try:
        parsed = StackFile.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise ConfigFileError(f"{path}: {where}: {first['msg']}") from exc
    labels = [entry.label for entry in parsed.versions]
    if len(set(labels)) != len(labels):
        raise ConfigFileError(f"{path}: versions: each label must be unique, got {labels}")
    for entry in parsed.versions:
        try:
            entry.generation_defaults  # noqa: B018 - validates the defaults now
        except ValueError as exc:
            raise ConfigFileError(f"{path}: versions[{entry.label}].defaults: {exc}") from exc
    return parsed


def with_version_names(policy: dict[str, Any], names: dict[str, str], where: str) -> dict[str, Any]:
    """``policy`` with version labels replaced by the versions' names (a name is kept)."""

    def name(label: Any, field: str) -> str:
        if isinstance(label, str) and label in names:
            return names[label]
        if isinstance(label, str) and label in names.values():
            return label
        raise ConfigFileError(f"{where}.{field}: no version labelled {label!r} in the file")

    return with_versions(
        policy, {field: name(label, field) for field, label in version_refs(policy)}
    )
