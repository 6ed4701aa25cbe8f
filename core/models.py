"""A model the gateway serves: what requests resolve their ``model`` field to."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    """What a model version fills in where a request sets nothing: part of the version's
    identity (a new default is a new version), applied by the gateway before admission."""

    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    """The output cap of a request that sets none (a plan's ``max_output_tokens`` wins)."""
    system_prompt: str | None = None
    """Put first in a chat request's messages unless they already start with a system one."""

    def to_dict(self) -> dict[str, Any]:
        """The fields that are set (a canonical form: hashed into the version id)."""
        return {name: value for name, value in self._items() if value is not None}

    def _items(self) -> tuple[tuple[str, Any], ...]:
        return (
            ("temperature", self.temperature),
            ("top_p", self.top_p),
            ("max_tokens", self.max_tokens),
            ("system_prompt", self.system_prompt),
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GenerationDefaults:
        """The inverse of ``to_dict``; ``ValueError`` naming the field for a bad value."""
        unknown = set(data) - {"temperature", "top_p", "max_tokens", "system_prompt"}
        if unknown:
            raise ValueError(
                f"unknown generation default(s) {sorted(unknown)}: use temperature, top_p, "
                "max_tokens, system_prompt"
            )
        temperature = _number(data, "temperature", 0.0, 2.0)
        top_p = _number(data, "top_p", 0.0, 1.0)
        max_tokens = data.get("max_tokens")
        if max_tokens is not None and (
            not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1
        ):
            raise ValueError("max_tokens: a whole number of tokens, at least 1")
        system_prompt = data.get("system_prompt")
        if system_prompt is not None and not isinstance(system_prompt, str):
            raise ValueError("system_prompt: a string")
        return cls(temperature, top_p, max_tokens, system_prompt or None)

    def apply(self, body: dict[str, Any], *, chat: bool) -> tuple[str, ...]:
        """Fill ``body``'s unset sampling fields (and a chat's system prompt) in place; the
        names of the fields filled (``unapply`` takes them back out)."""
        filled: list[str] = []
        if self.temperature is not None and body.get("temperature") is None:
            body["temperature"] = self.temperature
            filled.append("temperature")
        if self.top_p is not None and body.get("top_p") is None:
            body["top_p"] = self.top_p
            filled.append("top_p")
        if chat and self.system_prompt is not None:
            messages = body.get("messages")
            if isinstance(messages, list) and not (
                messages and isinstance(messages[0], dict) and messages[0].get("role") == "system"
            ):
                body["messages"] = [{"role": "system", "content": self.system_prompt}, *messages]
                filled.append("system_prompt")
        return tuple(filled)


def unapply_defaults(body: dict[str, Any], filled: tuple[str, ...]) -> None:
    """Take the fields ``GenerationDefaults.apply`` filled back out of ``body``."""
    for name in filled:
        if name == "system_prompt":
            body["messages"] = body["messages"][1:]
        else:
            body.pop(name, None)


def _number(data: dict[str, Any], name: str, low: float, high: float) -> float | None:
    value = data.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise ValueError(f"{name}: a number from {low:g} to {high:g}")
    return float(value)


@dataclass(frozen=True, slots=True)
class ServedModel:
    """A model the gateway serves, as ``/v1/models`` lists it."""

    name: str
    """The alias clients send as ``model``."""
    max_model_len: int | None
    created: int
    version: str | None = None
    """The exact version served, ``<alias>@<8 hex of its id>`` for a registered one (responses
    name it; price cards, the ledger and measured cost are keyed by it); None: the name."""
    deployment: str = "default"
    """The deployment serving it (a rollout arm, in time)."""
    tokenizer_dir: Path | None = None
    """The model folder whose ``tokenizer.json`` counts its prompts; None: the gateway's
    default count (the first version's tokenizer, else about 4 characters a token)."""
    served_as: str | None = None
    """The name its workers serve (``--served-model-name``), sent to them as ``model``; None:
    ``version_name`` (how ``tandem up`` launches them)."""
    defaults: GenerationDefaults = field(default_factory=GenerationDefaults)
    """Sampling defaults and system prompt of the version (its ``max_tokens`` default is
    ``default_max_tokens``)."""
    default_max_tokens: int | None = None
    """The output cap of a chat request that sets none (a plan's ``max_output_tokens`` wins);
    None: up to the context window, as OpenAI's API. See ``output_cap``."""
    kv_block_bytes: int | None = None
    """Bytes one KV block holds on its workers, to count what each transfer hands over; None
    when the model's shape is not known (external workers without a model folder)."""

    @property
    def version_name(self) -> str:
        """What responses name as their ``model``: the version, else the alias."""
        return self.version or self.name

    @property
    def engine_name(self) -> str:
        """The ``model`` its workers are sent."""
        return self.served_as or self.version_name

    @property
    def output_cap(self) -> int | None:
        """``default_max_tokens``, within the context window."""
        if self.default_max_tokens is None:
            return None
        return self.within_window(self.default_max_tokens)

    def within_window(self, max_tokens: int) -> int:
        """``max_tokens`` no longer than the context window: the engine refuses a larger one
        (it shortens one that only the prompt pushes past the window)."""
        return max_tokens if self.max_model_len is None else min(max_tokens, self.max_model_len)

    def kv_bytes(self, num_blocks: int) -> int | None:
        """What ``num_blocks`` KV blocks hold, where the model's shape is known."""
        return None if self.kv_block_bytes is None else num_blocks * self.kv_block_bytes
