"""Moderation types shared by the packages: categories, actions, a tenant's policy, decisions.

The policy lives with the tenant's plan (``admission`` stores it, the admin API edits it),
``moderation`` applies it, and every decision is recorded on the ``Request`` (billing reads it);
so the types sit here, below all of them.

A policy names, per stage (input before admission, output on the stream), the providers that
check the text and what to do per category::

    {"input":  {"providers": ["rules"], "actions": {"pii": "redact", "*": "block"}},
     "output": {"providers": ["rules"], "actions": {"pii": "redact", "violence": "flag"}}}

``"*"`` is the action for categories the map does not name; without it they are allowed.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any


class Category(enum.StrEnum):
    """OpenAI's 13 moderation categories, plus ``pii`` for personal data detectors."""

    HATE = "hate"
    HATE_THREATENING = "hate/threatening"
    HARASSMENT = "harassment"
    HARASSMENT_THREATENING = "harassment/threatening"
    ILLICIT = "illicit"
    ILLICIT_VIOLENT = "illicit/violent"
    SELF_HARM = "self-harm"
    SELF_HARM_INTENT = "self-harm/intent"
    SELF_HARM_INSTRUCTIONS = "self-harm/instructions"
    SEXUAL = "sexual"
    SEXUAL_MINORS = "sexual/minors"
    VIOLENCE = "violence"
    VIOLENCE_GRAPHIC = "violence/graphic"
    PII = "pii"


OPENAI_CATEGORIES: tuple[Category, ...] = tuple(c for c in Category if c is not Category.PII)
"""The 13 keys of every map in a ``/v1/moderations`` result, in OpenAI's order."""


class Action(enum.StrEnum):
    """What a policy does with a hit, from mildest to strictest."""

    ALLOW = "allow"  # ignore the hit
    FLAG = "flag"  # record it, change nothing
    REDACT = "redact"  # replace the matched text (spans only: a whole-text hit is blocked)
    BLOCK = "block"  # input: refuse with 400 content_filter; output: end the choice

    @property
    def severity(self) -> int:
        return _SEVERITY[self]


_SEVERITY = {Action.ALLOW: 0, Action.FLAG: 1, Action.REDACT: 2, Action.BLOCK: 3}


class Stage(enum.StrEnum):
    """Where a decision was taken."""

    INPUT = "input"
    OUTPUT = "output"


WILDCARD = "*"


@dataclass(frozen=True, slots=True)
class StagePolicy:
    """Providers and per-category actions for one stage; no providers = the stage is off."""

    providers: tuple[str, ...] = ()
    actions: Mapping[str, Action] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def enabled(self) -> bool:
        return bool(self.providers) and any(a is not Action.ALLOW for a in self.actions.values())

    def action_for(self, category: Category) -> Action:
        return self.actions.get(category.value) or self.actions.get(WILDCARD) or Action.ALLOW

    def to_dict(self) -> dict[str, Any]:
        return {
            "providers": list(self.providers),
            "actions": {key: action.value for key, action in sorted(self.actions.items())},
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str) -> StagePolicy:
        """``ValueError`` names the bad field (``where`` is its path, e.g. ``moderation.input``)."""
        providers = data.get("providers", [])
        if not isinstance(providers, list) or not all(isinstance(p, str) and p for p in providers):
            raise ValueError(f"{where}.providers must be a list of provider names")
        raw_actions = data.get("actions", {})
        if not isinstance(raw_actions, Mapping):
            raise ValueError(f"{where}.actions must map categories to actions")
        known = {c.value for c in Category} | {WILDCARD}
        actions: dict[str, Action] = {}
        for key, value in raw_actions.items():
            if key not in known:
                raise ValueError(
                    f"{where}.actions: unknown category {key!r}; use one of "
                    f"{', '.join(sorted(known))}"
                )
            try:
                actions[key] = Action(value)
            except ValueError:
                choices = ", ".join(a.value for a in Action)
                raise ValueError(
                    f"{where}.actions.{key} must be one of {choices}, got {value!r}"
                ) from None
        return cls(tuple(providers), MappingProxyType(actions))


@dataclass(frozen=True, slots=True)
class ModerationPolicy:
    """A tenant's moderation: what is checked on input and on output."""

    input: StagePolicy = field(default_factory=StagePolicy)
    output: StagePolicy = field(default_factory=StagePolicy)

    def stage(self, stage: Stage) -> StagePolicy:
        return self.input if stage is Stage.INPUT else self.output

    def to_dict(self) -> dict[str, Any]:
        return {"input": self.input.to_dict(), "output": self.output.to_dict()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "moderation") -> ModerationPolicy:
        unknown = set(data) - {"input", "output"}
        if unknown:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)}; use input and output")
        return cls(
            input=StagePolicy.from_dict(data.get("input") or {}, f"{where}.input"),
            output=StagePolicy.from_dict(data.get("output") or {}, f"{where}.output"),
        )


@dataclass(frozen=True, slots=True)
class ModerationDecision:
    """One moderation outcome recorded with a request (flags included)."""

    stage: Stage
    provider: str
    category: Category
    action: Action
    detector: str | None = None
    """The rule that matched (e.g. ``email``, ``payment_card``, a term list), when known."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "stage": self.stage.value,
            "provider": self.provider,
            "category": self.category.value,
            "action": self.action.value,
            "detector": self.detector,
        }
