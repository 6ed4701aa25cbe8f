"""The pre-traffic quality check: a golden prompt set answered by both versions must agree.

Before a candidate version gets any client traffic, every golden prompt runs at temperature 0 on
the baseline and on the candidate, and each pair of answers is compared. It catches a candidate
that serves garbage (the same SmolLM2-135M-Instruct in bf16 on vLLM's CPU build answers
"cTypesAndAnd ..." where fp32 answers "The capital of France is Paris.") before a single client
sees it, while a healthy candidate that words things a little differently passes.

The measure, and why:

- **Tokens**: lowercase the text, then take words (``\\w+``: letters, digits, underscore, any
  script) and single punctuation characters (any other non-space character), in order;
  whitespace separates and is dropped. ``"Paris, France."`` is ``paris , france .``. The gateway
  has no tokenizer per version here, and two versions may not share one: a word-level rule
  compares two tokenizers' outputs fairly, and ignores how the engine spaced or cased them.
- **Prefix match**: the first ``prefix_tokens`` (8) tokens of both answers are identical. When an
  answer has fewer, the comparison stops at the shorter one's length, less its closing
  punctuation (the full stop of "A year is 365 days." is where the other answer goes on with
  ", but ..."), so a terser answer that starts the same way matches; an empty answer matches
  only an empty answer. At temperature 0 a healthy candidate usually starts exactly as the
  baseline does and drifts, if at all, later in the answer (a tiny numeric difference flips one
  token, and greedy decoding follows it). The price: an answer cut short after a word or two
  that the other also starts with matches too.
- **Overlap**: token F1 between the two answers, as SQuAD scores an answer: the tokens both
  answers share (as bags: a token twice in each counts twice) over each answer's length give
  precision P and recall R, and F1 = 2PR / (P + R); 1.0 when both answers are empty, 0.0 when
  one is. It sees an answer that says the same thing in another order or with another opening
  ("Paris is the capital of France." against "The capital of France is Paris.": F1 1.0).
- A prompt **agrees** when its answers match on the prefix or overlap by at least
  ``min_overlap`` (0.5). Garbage matches neither: it shares almost no words with a real answer.
- The set **passes** when the share of agreeing prompts is at least ``min_agreement`` (0.8) and
  **fails** below it. One bad prompt in five is tolerated: a candidate with, say, a different
  system prompt answers some prompts in quite other words, while a broken one disagrees on
  nearly all of them.
- An engine failure on any prompt, on either version, makes the outcome **error**: neither pass
  nor fail, as a gate's error in ``rollouts.gates`` holds a step. Its detail names the prompts
  and the versions that failed; the controller runs the check again.

The shipped set (``golden_prompts.json``), measured with SmolLM2-135M-Instruct under
transformers on CPU (greedy, 48 new tokens), fp32 with the model's own default system prompt as
the baseline: bf16 weights agree on 22 of 22 prompts; the system prompts "Answer as briefly as
possible." and "You are a helpful assistant." on 22 of 22, in fp32 and in bf16; "You are a
concise, accurate assistant." on 21 of 22. Gaussian noise added to every weight matrix (a share
of each matrix's standard deviation) fails it: 0.5 and 0.2 (garbage) agree on 0 of 22, 0.1 on 5,
and 0.05, which still answers "The capital of France is Paris.", on 16 of 22 (73 %). The set is
the 22 of 66 candidate prompts on which bf16 and the first two system prompts in fp32 agreed;
the other runs above played no part in choosing it.

``run_check`` asks a ``Completer`` (the caller's client of the engines; it sets temperature 0 and
a fixed seed) for every prompt's answer from both versions, at most ``concurrency`` calls at a
time, then ``judge`` folds the comparisons into a ``QualityResult``. Everything else is pure
but ``default_prompts``, which reads the shipped set from the package once.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Any, Literal, Protocol, TypeGuard, cast, get_args

MAX_PROMPTS = 200
"""The most golden prompts one check may have."""
MAX_ANSWER_TOKENS = 1024
"""The largest ``max_tokens`` a check may ask for: long answers at temperature 0 drift apart on
tiny numeric differences, which the measure is not meant to judge."""
ROLES = frozenset({"system", "developer", "user", "assistant"})
"""The chat roles a golden prompt's messages may have."""
_MAX_ERROR_CHARS = 300
"""An engine error's message is cut to this many characters (the result is persisted)."""
_TOKEN = re.compile(r"\w+|[^\w\s]")
_WORD = re.compile(r"\w")

Outcome = Literal["pass", "fail", "error"]
_OUTCOMES: frozenset[str] = frozenset(get_args(Outcome))


@dataclass(frozen=True, slots=True)
class GoldenPrompt:
    """One prompt of the set, sent as is to both versions."""

    id: str
    """Unique within the set; names the prompt in results and errors."""
    messages: tuple[dict[str, str], ...]
    """OpenAI chat messages (``role``, ``content``), the last one the user's."""

    def __post_init__(self) -> None:
        if not isinstance(self.id, str) or not self.id.strip():
            raise ValueError("a golden prompt's id must be a non-empty string")
        where = f"golden prompt {self.id!r}"
        if not isinstance(self.messages, tuple) or not self.messages:
            raise ValueError(f"{where}: messages must be a non-empty tuple of chat messages")
        copied = []
        for number, message in enumerate(self.messages):
            if (
                not isinstance(message, Mapping)
                or set(message) != {"role", "content"}
                or not all(isinstance(value, str) for value in message.values())
            ):
                raise ValueError(
                    f"{where}: messages[{number}] must be {{'role': str, 'content': str}}"
                )
            if message["role"] not in ROLES:
                roles = ", ".join(sorted(ROLES))
                raise ValueError(
                    f"{where}: messages[{number}].role {message['role']!r} is not one of: {roles}"
                )
            copied.append({"role": message["role"], "content": message["content"]})
        if copied[-1]["role"] != "user":
            raise ValueError(
                f"{where}: the last message must be the user's, for the model to answer"
            )
        # Copies: a caller's later change to its dicts must not change a frozen prompt.
        object.__setattr__(self, "messages", tuple(copied))

    def to_dict(self) -> dict[str, Any]:
        """JSON-able."""
        return {"id": self.id, "messages": [dict(message) for message in self.messages]}


@dataclass(frozen=True, slots=True)
class QualityCheck:
    """A rollout's settings for its pre-traffic quality check (see the module docstring)."""

    prompts: tuple[GoldenPrompt, ...] | None = None
    """The golden set; None: the shipped default set (``default_prompts``)."""
    prefix_tokens: int = 8
    """How many leading tokens must be identical for a prefix match."""
    min_overlap: float = 0.5
    """The token F1 at or over which two answers agree, prefix or not (0 < x <= 1)."""
    min_agreement: float = 0.8
    """The share of agreeing prompts at or over which the set passes (0 < x <= 1)."""
    max_tokens: int = 48
    """The most tokens each answer may have (the engine's ``max_tokens``)."""
    enabled: bool = True
    """False: the controller skips the check. ``run_check`` and ``judge`` do not read it."""

    def __post_init__(self) -> None:
        if self.prompts is not None:
            if not isinstance(self.prompts, tuple) or not all(
                isinstance(prompt, GoldenPrompt) for prompt in self.prompts
            ):
                raise ValueError("quality check: prompts must be a tuple of GoldenPrompt, or None")
            if not 1 <= len(self.prompts) <= MAX_PROMPTS:
                raise ValueError(
                    f"quality check: prompts must number 1 to {MAX_PROMPTS}, not "
                    f"{len(self.prompts)} (None for the default set)"
                )
            _check_unique(prompt.id for prompt in self.prompts)
        if not _is_int(self.prefix_tokens) or self.prefix_tokens < 1:
            raise ValueError("quality check: prefix_tokens must be an integer of at least 1")
        for name in ("min_overlap", "min_agreement"):
            value = getattr(self, name)
            if not _is_number(value) or not (math.isfinite(value) and 0 < value <= 1):
                raise ValueError(
                    f"quality check: {name} must be a share, more than 0 and at most 1"
                )
            object.__setattr__(self, name, float(value))
        if not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= MAX_ANSWER_TOKENS:
            raise ValueError(
                f"quality check: max_tokens must be an integer from 1 to {MAX_ANSWER_TOKENS}"
            )
        if not isinstance(self.enabled, bool):
            raise ValueError("quality check: enabled must be true or false")

    def to_dict(self) -> dict[str, Any]:
        """JSON-able; ``from_dict`` reads it back."""
        return {
            "prompts": None if self.prompts is None else [p.to_dict() for p in self.prompts],
            "prefix_tokens": self.prefix_tokens,
            "min_overlap": self.min_overlap,
            "min_agreement": self.min_agreement,
            "max_tokens": self.max_tokens,
            "enabled": self.enabled,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> QualityCheck:
        """A check from its ``to_dict`` form, or as an operator writes it: fields left out take
        their defaults, and ``prompts`` may be a list of ``{"id", "messages"}`` objects or of
        plain strings (each one user message, id ``prompt-<n>`` by its 1-based position).
        Raises ``ValueError`` naming the field that is wrong."""
        if not isinstance(data, Mapping):
            raise ValueError("quality check: expected an object of settings")
        unknown = sorted(set(data) - set(_CHECK_FIELDS))
        if unknown:
            raise ValueError(
                f"quality check: unknown field(s) {', '.join(map(repr, unknown))}; "
                f"known: {', '.join(_CHECK_FIELDS)}"
            )
        raw = data.get("prompts")
        prompts = None if raw is None else _prompts_from(raw, "quality check: prompts")
        # Types are checked by __post_init__: the number fields pass through as given.
        settings = {name: data[name] for name in _CHECK_FIELDS[1:] if name in data}
        return cls(prompts=prompts, **settings)


_CHECK_FIELDS = (
    "prompts",
    "prefix_tokens",
    "min_overlap",
    "min_agreement",
    "max_tokens",
    "enabled",
)


@cache
def default_prompts() -> tuple[GoldenPrompt, ...]:
    """The shipped golden set, ``rollouts/golden_prompts.json``, read once."""
    source = resources.files("rollouts").joinpath("golden_prompts.json")
    data = json.loads(source.read_text(encoding="utf-8"))
    if not isinstance(data, dict) or data.get("version") != 1:
        raise ValueError(f"{source}: expected {{'version': 1, 'prompts': [...]}}")
    prompts = _prompts_from(data.get("prompts"), f"{source}: prompts")
    # The shipped set obeys the same limits as an operator's.
    QualityCheck(prompts=prompts)
    return prompts


def tokens(text: str) -> list[str]:
    """``text``'s tokens for comparison: lowercased words (``\\w+``) and single punctuation
    characters, in order (see the module docstring)."""
    return _TOKEN.findall(text.lower())


@dataclass(frozen=True, slots=True)
class PromptAgreement:
    """How one prompt's two answers compare."""

    prompt_id: str
    baseline_text: str | None
    """The baseline's answer; None when its engine failed."""
    candidate_text: str | None
    """The candidate's answer; None when its engine failed."""
    prefix_match: bool
    """The first ``prefix_tokens`` tokens are identical, up to the shorter answer's end (see the
    module docstring); False on an error."""
    overlap: float
    """Token F1 of the two answers, 0 to 1 (0 on an error)."""
    agrees: bool
    """``prefix_match`` or ``overlap >= min_overlap`` (False on an error)."""
    error: str | None = None
    """``"baseline: <type>: <message>"`` and/or ``"candidate: ..."`` (joined by ``"; "``) when
    an engine failed on the prompt; None otherwise."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-able; ``from_dict`` reads it back."""
        return {
            "prompt_id": self.prompt_id,
            "baseline_text": self.baseline_text,
            "candidate_text": self.candidate_text,
            "prefix_match": self.prefix_match,
            "overlap": self.overlap,
            "agrees": self.agrees,
            "error": self.error,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PromptAgreement:
        """The ``to_dict`` form read back; raises ``ValueError`` naming a field that is wrong."""
        where = "prompt agreement"
        _require(data, where, ("prompt_id", str), ("prefix_match", bool), ("agrees", bool))
        for name in ("baseline_text", "candidate_text", "error"):
            if data.get(name) is not None and not isinstance(data[name], str):
                raise ValueError(f"{where}: {name} must be a string or null")
        overlap = data.get("overlap")
        if not _is_number(overlap) or not 0 <= overlap <= 1:
            raise ValueError(f"{where}: overlap must be a number from 0 to 1")
        return cls(
            prompt_id=data["prompt_id"],
            baseline_text=data.get("baseline_text"),
            candidate_text=data.get("candidate_text"),
            prefix_match=data["prefix_match"],
            overlap=float(overlap),
            agrees=data["agrees"],
            error=data.get("error"),
        )


def compare(
    prompt_id: str, baseline_text: str, candidate_text: str, check: QualityCheck
) -> PromptAgreement:
    """How ``candidate_text`` agrees with ``baseline_text`` under ``check``'s thresholds."""
    ours, theirs = tokens(candidate_text), tokens(baseline_text)
    prefix_match = _prefix_match(ours, theirs, check.prefix_tokens)
    overlap = _f1(ours, theirs)
    return PromptAgreement(
        prompt_id=prompt_id,
        baseline_text=baseline_text,
        candidate_text=candidate_text,
        prefix_match=prefix_match,
        overlap=overlap,
        agrees=prefix_match or overlap >= check.min_overlap,
    )


def _prefix_match(ours: Sequence[str], theirs: Sequence[str], prefix_tokens: int) -> bool:
    if not ours or not theirs:
        return not ours and not theirs
    length = min(prefix_tokens, len(ours), len(theirs))
    if length < prefix_tokens:
        # The shorter answer ends inside the prefix: its closing punctuation is where the other
        # goes on ("... 365 days." against "... 365 days, but ..."), so it is not compared.
        shorter = ours if len(ours) <= len(theirs) else theirs
        while length > 1 and not _WORD.match(shorter[length - 1]):
            length -= 1
    return ours[:length] == theirs[:length]


def _f1(ours: Sequence[str], theirs: Sequence[str]) -> float:
    if not ours or not theirs:
        return 1.0 if not ours and not theirs else 0.0
    shared = sum((Counter(ours) & Counter(theirs)).values())
    if shared == 0:
        return 0.0
    precision, recall = shared / len(ours), shared / len(theirs)
    return 2 * precision * recall / (precision + recall)


@dataclass(frozen=True, slots=True)
class QualityResult:
    """The check's outcome over the whole set."""

    outcome: Outcome
    """``pass``: promote to the first traffic step; ``fail``: roll back; ``error``: an engine
    failed on some prompt, run the check again."""
    agreement: float
    """The share of prompts that agree; a prompt with an error does not."""
    min_agreement: float
    """The check's threshold, kept with the result."""
    prompts: tuple[PromptAgreement, ...] = field(default=())
    """Every prompt's comparison, in the order of the set."""
    detail: str = ""
    """The outcome in one sentence, for an operator."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-able; ``from_dict`` reads it back."""
        return {
            "outcome": self.outcome,
            "agreement": self.agreement,
            "min_agreement": self.min_agreement,
            "prompts": [prompt.to_dict() for prompt in self.prompts],
            "detail": self.detail,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> QualityResult:
        """The ``to_dict`` form read back (the controller persists results); raises
        ``ValueError`` naming a field that is wrong."""
        where = "quality result"
        _require(data, where, ("outcome", str), ("detail", str), ("prompts", list))
        if data["outcome"] not in _OUTCOMES:
            raise ValueError(f"{where}: outcome must be one of: {', '.join(sorted(_OUTCOMES))}")
        for name in ("agreement", "min_agreement"):
            value = data.get(name)
            if not _is_number(value) or not 0 <= value <= 1:
                raise ValueError(f"{where}: {name} must be a number from 0 to 1")
        prompts = []
        for number, item in enumerate(data["prompts"]):
            if not isinstance(item, Mapping):
                raise ValueError(f"{where}: prompts[{number}] must be an object")
            try:
                prompts.append(PromptAgreement.from_dict(item))
            except ValueError as error:
                raise ValueError(f"{where}: prompts[{number}]: {error}") from None
        return cls(
            outcome=cast(Outcome, data["outcome"]),
            agreement=float(data["agreement"]),
            min_agreement=float(data["min_agreement"]),
            prompts=tuple(prompts),
            detail=data["detail"],
        )


def judge(check: QualityCheck, results: Sequence[PromptAgreement]) -> QualityResult:
    """The set's outcome from every prompt's comparison: ``error`` when an engine failed on any
    prompt, else ``pass`` when the share of agreeing prompts is at least ``min_agreement``, else
    ``fail``."""
    if not results:
        raise ValueError("judge needs the comparison of at least one prompt")
    prompts = tuple(results)
    num_agreeing = sum(1 for result in prompts if result.agrees)
    agreement = num_agreeing / len(prompts)
    errored = [result for result in prompts if result.error is not None]
    if errored:
        named = "; ".join(f"{result.prompt_id} ({result.error})" for result in errored[:3])
        more = f" and {len(errored) - 3} more" if len(errored) > 3 else ""
        detail = (
            f"An engine failed on {len(errored)} of {len(prompts)} golden prompts: "
            f"{named}{more}. Run the check again once the versions serve."
        )
        return QualityResult("error", agreement, check.min_agreement, prompts, detail)
    # k / n and the threshold are both correctly rounded, so a share exactly at the threshold
    # (4 of 5 against 0.8) compares equal and passes.
    passed = agreement >= check.min_agreement
    said = (
        f"{num_agreeing} of {len(prompts)} golden prompts agreed ({agreement:.0%}), "
        f"{'at or over' if passed else 'under'} the {check.min_agreement:.0%} minimum"
    )
    disagreeing = [result.prompt_id for result in prompts if not result.agrees]
    if disagreeing:
        more = f" and {len(disagreeing) - 5} more" if len(disagreeing) > 5 else ""
        said += f"; disagreed: {', '.join(disagreeing[:5])}{more}"
    return QualityResult(
        "pass" if passed else "fail", agreement, check.min_agreement, prompts, said + "."
    )


class Completer(Protocol):
    """What ``run_check`` asks for answers: the caller's client of the versions' engines."""

    async def complete(
        self, version: str, messages: Sequence[Mapping[str, str]], *, max_tokens: int
    ) -> str:
        """The version's answer at temperature 0 (the caller's implementation sets temperature=0
        and seed), at most ``max_tokens`` tokens long. Raises any ``Exception`` on engine failure;
        bounds its own wait (a timeout is such a failure)."""
        ...


async def run_check(
    check: QualityCheck,
    completer: Completer,
    baseline: str,
    candidate: str,
    *,
    concurrency: int = 4,
) -> QualityResult:
    """Every golden prompt answered by ``baseline`` and ``candidate`` (version ids, passed to the
    completer as given), at most ``concurrency`` calls at a time, then ``judge``. An exception
    from ``complete`` becomes its prompt's error; cancellation cancels every call in flight and
    propagates."""
    if not _is_int(concurrency) or concurrency < 1:
        raise ValueError("run_check: concurrency must be an integer of at least 1")
    # The default set is read from the package's files on first use: off the event loop.
    prompts = (
        check.prompts if check.prompts is not None else await asyncio.to_thread(default_prompts)
    )
    semaphore = asyncio.Semaphore(concurrency)

    async def answer(version: str, prompt: GoldenPrompt) -> str | Exception:
        async with semaphore:
            try:
                return await completer.complete(
                    version, prompt.messages, max_tokens=check.max_tokens
                )
            # The Completer's contract: any Exception is an engine failure, recorded against
            # its prompt. CancelledError is no Exception: it propagates.
            except Exception as error:  # noqa: BLE001
                return error

    # The TaskGroup owns every call: one that raises past ``answer`` (cancellation) cancels the
    # others before run_check returns.
    async with asyncio.TaskGroup() as group:
        calls = [
            (
                prompt,
                group.create_task(answer(baseline, prompt)),
                group.create_task(answer(candidate, prompt)),
            )
            for prompt in prompts
        ]
    return judge(
        check,
        [
            _agreement(check, prompt, baseline_call.result(), candidate_call.result())
            for prompt, baseline_call, candidate_call in calls
        ],
    )


def _agreement(
    check: QualityCheck,
    prompt: GoldenPrompt,
    baseline: str | Exception,
    candidate: str | Exception,
) -> PromptAgreement:
    if isinstance(baseline, str) and isinstance(candidate, str):
        return compare(prompt.id, baseline, candidate, check)
    errors = [
        f"{side}: {type(answer).__name__}: {answer}"[:_MAX_ERROR_CHARS]
        for side, answer in (("baseline", baseline), ("candidate", candidate))
        if isinstance(answer, Exception)
    ]
    return PromptAgreement(
        prompt_id=prompt.id,
        baseline_text=baseline if isinstance(baseline, str) else None,
        candidate_text=candidate if isinstance(candidate, str) else None,
        prefix_match=False,
        overlap=0.0,
        agrees=False,
        error="; ".join(errors),
    )


def _prompts_from(raw: object, where: str) -> tuple[GoldenPrompt, ...]:
    """Golden prompts from a JSON list of ``{"id", "messages"}`` objects or plain strings."""
    if not isinstance(raw, list):
        raise ValueError(f"{where}: expected a list of prompts (strings or {{id, messages}})")
    if len(raw) > MAX_PROMPTS:
        raise ValueError(f"{where}: {len(raw)} prompts, at most {MAX_PROMPTS} allowed")
    prompts = []
    for number, item in enumerate(raw):
        at = f"{where}[{number}]"
        if isinstance(item, str):
            if not item.strip():
                raise ValueError(f"{at}: an empty prompt; give the question to ask")
            messages: object = [{"role": "user", "content": item}]
            prompt_id: object = f"prompt-{number + 1}"
        elif isinstance(item, Mapping):
            if set(item) != {"id", "messages"}:
                raise ValueError(f"{at}: expected exactly the fields 'id' and 'messages'")
            prompt_id, messages = item["id"], item["messages"]
            if not isinstance(messages, list):
                raise ValueError(f"{at}.messages: expected a list of {{role, content}} objects")
        else:
            raise ValueError(f"{at}: expected a string or an object with 'id' and 'messages'")
        try:
            prompts.append(GoldenPrompt(cast(str, prompt_id), tuple(cast(list[Any], messages))))
        except ValueError as error:
            raise ValueError(f"{at}: {error}") from None
    result = tuple(prompts)
    _check_unique((prompt.id for prompt in result), where)
    return result


def _check_unique(ids: Iterable[str], where: str = "quality check: prompts") -> None:
    seen: set[str] = set()
    for prompt_id in ids:
        if prompt_id in seen:
            raise ValueError(f"{where}: the id {prompt_id!r} is used twice; ids must be unique")
        seen.add(prompt_id)


def _require(data: Mapping[str, Any], where: str, *fields: tuple[str, type]) -> None:
    for name, kind in fields:
        if not isinstance(data.get(name), kind):
            raise ValueError(f"{where}: {name} must be {_KIND_NAMES[kind]}")


_KIND_NAMES = {str: "a string", bool: "true or false", list: "a list"}


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)
