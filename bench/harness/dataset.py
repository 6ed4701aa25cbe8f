"""The prompts a benchmark sends: synthetic ones of exact token lengths, or a shipped chat set.

Lengths are counted with the served model's own ``tokenizer.json`` (the Rust ``tokenizers``
library, no torch), without special tokens or chat template: that is the part the dataset
controls; the server's ``prompt_tokens`` adds the template on top. Every random choice comes
from the caller's ``numpy.random.Generator``, so one seed gives the same prompts every run.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Literal

import numpy as np
from tokenizers import Tokenizer

from workers.model import ModelPreparationError, find_prepared

__all__ = [
    "DatasetError",
    "LengthDistribution",
    "Prompt",
    "chat_prompts",
    "describe_tokens",
    "load_tokenizer",
    "synthetic_prompts",
    "write_vllm_custom_jsonl",
]

_FORMS = "fixed:N, uniform:MIN:MAX, normal:MEAN:STD or lognormal:MEDIAN:SIGMA"
_ARITY = {"fixed": 1, "uniform": 2, "normal": 2, "lognormal": 2}
_MAX_FIXUPS = 8  # decode/re-encode rounds before padding word by word
_MAX_DRAWS = 32  # offsets tried for a prompt unlike the ones already made
_OPENING = 16  # tokens that must differ: a prefix cache hits whole blocks (vLLM's are 16)
_PAD_WORDS = (" the", " and", " a", ".", " x")  # one token each in common tokenizers


class DatasetError(ValueError):
    """A tokenizer or prompt set cannot be built; the message says what to do."""


@dataclass(frozen=True, slots=True)
class Prompt:
    """One prompt to send, with the lengths the report compares the server's counts to."""

    text: str
    """The user message (chat) or the prompt string (completions)."""
    tokens: int
    """Its length in the served model's tokenizer: no special tokens, no chat template."""
    output_tokens: int
    """The ``max_tokens`` to ask for."""
    prefix_group: int | None = None
    """Which shared prefix it starts with; None when it shares none."""


@dataclass(frozen=True, slots=True)
class LengthDistribution:
    """Token lengths drawn one per prompt, written on the command line as e.g.
    ``lognormal:128:0.5``. Draws are rounded and clipped to at least 1."""

    kind: Literal["fixed", "uniform", "normal", "lognormal"]
    params: tuple[float, ...]
    """fixed: (N,); uniform: (MIN, MAX) inclusive; normal: (MEAN, STD); lognormal: (MEDIAN,
    SIGMA), sigma of the underlying normal, so half the draws fall below MEDIAN."""

    def __post_init__(self) -> None:
        if (why := _invalid(self.kind, self.params)) is not None:
            raise ValueError(_bad_spec(self.describe(), why))

    @classmethod
    def parse(cls, spec: str) -> LengthDistribution:
        """The distribution a spec names; ValueError naming the spec and the accepted forms."""
        kind, *fields = spec.strip().split(":")
        if kind not in _ARITY or len(fields) != _ARITY[kind]:
            raise ValueError(_bad_spec(spec, "unknown form"))
        try:
            params = tuple(float(field) for field in fields)
        except ValueError:
            raise ValueError(_bad_spec(spec, "parameters must be numbers")) from None
        if (why := _invalid(kind, params)) is not None:
            raise ValueError(_bad_spec(spec, why))
        return cls(kind, params)  # type: ignore[arg-type]  # kind checked against _ARITY

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        """``n`` lengths, each an int >= 1."""
        first, second = self.params[0], self.params[-1]
        if self.kind == "fixed":
            values = np.full(n, first)
        elif self.kind == "uniform":
            values = rng.integers(int(first), int(second), size=n, endpoint=True).astype(float)
        elif self.kind == "normal":
            values = rng.normal(first, second, size=n)
        else:
            values = rng.lognormal(math.log(first), second, size=n)
        return [int(value) for value in np.maximum(np.rint(values), 1)]

    def describe(self) -> str:
        """The spec again, e.g. ``lognormal:128:0.5``: what a report records."""
        return ":".join([self.kind, *(_number(param) for param in self.params)])


def load_tokenizer(spec: str | Path | None) -> Tokenizer:
    """The tokenizer to count with: a ``tokenizer.json`` file, a folder holding one, or (None)
    the bundled model's prepared folder, the model ``tandem`` serves by default."""
    if spec is None:
        try:
            prepared = find_prepared()
        except ModelPreparationError as exc:
            raise DatasetError(f"no tokenizer given, and {exc}; or pass --tokenizer") from exc
        if prepared is None:
            raise DatasetError(
                "no tokenizer given, and the bundled model is not prepared yet: run "
                "`tandem model prepare`, or pass --tokenizer with a tokenizer.json file or a "
                "model folder holding one"
            )
        spec = prepared.path
    path = Path(spec).expanduser()
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise DatasetError(
            f"no tokenizer at {file}: --tokenizer takes a tokenizer.json file or a model "
            "folder holding one (`tandem model prepare` makes one for the bundled model)"
        )
    try:
        return Tokenizer.from_file(str(file))
    except Exception as exc:  # the Rust binding raises bare Exception for a malformed file
        raise DatasetError(f"{file} is not a usable tokenizer.json: {exc}") from exc


def synthetic_prompts(
    tokenizer: Tokenizer,
    rng: np.random.Generator,
    n: int,
    input_len: LengthDistribution,
    output_len: LengthDistribution,
    *,
    shared_prefix_tokens: int = 0,
    prefix_groups: int = 1,
) -> list[Prompt]:
    """``n`` prompts of natural English of exactly the drawn token counts, each cut from a
    different place of the shipped prompts' text so that within one call no two open with the
    same 16 tokens and a prefix cache cannot trivially hit.

    With ``shared_prefix_tokens`` > 0, prompt ``i`` is shared prefix ``i % prefix_groups``
    (exactly ``shared_prefix_tokens`` tokens on its own), a newline, then its own text:
    ``input_len`` then draws the length of that suffix (the newline counted in it), and
    ``Prompt.tokens`` is the exact total. That is the prefix-cache workload: the prefix's
    tokens repeat, what follows does not.
    """
    if n < 0 or shared_prefix_tokens < 0 or prefix_groups < 1:
        raise ValueError("n and shared_prefix_tokens must be >= 0 and prefix_groups >= 1")
    lengths = input_len.sample(rng, n)
    outputs = output_len.sample(rng, n)
    corpus = _Corpus(tokenizer, longest=max([shared_prefix_tokens, *lengths]))
    if shared_prefix_tokens == 0:
        return [
            Prompt(corpus.cut(rng, length), length, output, None)
            for length, output in zip(lengths, outputs, strict=True)
        ]
    prefixes = [corpus.cut(rng, shared_prefix_tokens) for _ in range(prefix_groups)]
    prompts = []
    for i, (length, output) in enumerate(zip(lengths, outputs, strict=True)):
        group = i % prefix_groups
        total = shared_prefix_tokens + length
        text = corpus.cut(rng, total, head=prefixes[group] + "\n")
        prompts.append(Prompt(text, total, output, group))
    return prompts


def chat_prompts(
    tokenizer: Tokenizer, rng: np.random.Generator, n: int, output_len: LengthDistribution
) -> list[Prompt]:
    """``n`` prompts drawn with replacement from the shipped chat set
    (``data/chat_prompts.jsonl``): realistic, varied requests of about 5 to 400 tokens."""
    texts = _shipped_texts()
    counts = [len(e.ids) for e in tokenizer.encode_batch(list(texts), add_special_tokens=False)]
    picks = rng.integers(len(texts), size=n)
    outputs = output_len.sample(rng, n)
    return [
        Prompt(texts[pick], counts[pick], output, None)
        for pick, output in zip(picks.tolist(), outputs, strict=True)
    ]


def write_vllm_custom_jsonl(prompts: Sequence[Prompt], path: Path) -> None:
    """The same prompts for ``vllm bench serve --dataset-name custom --dataset-path PATH``,
    one ``{"prompt", "output_tokens"}`` object per line, so both tools send identical requests.

    vLLM shuffles custom data and overrides ``output_tokens`` with a default of 256, and it
    wraps each prompt in the chat template itself: to compare, pass ``--disable-shuffle
    --custom-output-len -1 --skip-chat-template`` (the server applies the template for chat).
    """
    with path.open("w", encoding="utf-8") as out:
        for prompt in prompts:
            line = {"prompt": prompt.text, "output_tokens": prompt.output_tokens}
            out.write(json.dumps(line, ensure_ascii=False) + "\n")


def describe_tokens(prompts: Sequence[Prompt]) -> dict[str, float | int]:
    """The dataset's shape for a report header."""
    inputs = [prompt.tokens for prompt in prompts]
    return {
        "count": len(inputs),
        "input_tokens_total": sum(inputs),
        "input_tokens_mean": sum(inputs) / len(inputs) if inputs else 0.0,
        "input_tokens_min": min(inputs, default=0),
        "input_tokens_max": max(inputs, default=0),
        "output_tokens_total": sum(prompt.output_tokens for prompt in prompts),
    }


class _Corpus:
    """The shipped prompts' text as one token-id sequence to cut windows from, repeated so
    that the longest window (and the fix-up that may lengthen it) fits after any offset."""

    def __init__(self, tokenizer: Tokenizer, longest: int) -> None:
        self._tokenizer = tokenizer
        ids = tokenizer.encode("\n\n".join(_shipped_texts()), add_special_tokens=False).ids
        self._period = len(ids)
        self._ids = ids * (2 + math.ceil((2 * longest + 64) / self._period))
        self._starts: set[int] = set()
        self._openings: set[tuple[str, tuple[int, ...]]] = set()

    def cut(self, rng: np.random.Generator, target: int, head: str = "") -> str:
        """``head`` plus text from an unused offset, exactly ``target`` tokens together, whose
        opening after ``head`` is new (nearby offsets can strip to the same opening). Falls
        back to a repeat only when short targets leave no new text to find."""
        skip = self._count(head)
        start, text = 0, head
        opening: tuple[str, tuple[int, ...]] = (head, ())
        for attempt in range(_MAX_DRAWS):
            start = int(rng.integers(self._period))
            if start in self._starts and attempt < _MAX_DRAWS - 1:
                continue
            text = self._fit(start, target, head)
            ids = self._tokenizer.encode(text, add_special_tokens=False).ids
            opening = (head, tuple(ids[skip : skip + _OPENING]))
            if opening not in self._openings:
                break
        self._starts.add(start)
        self._openings.add(opening)
        return text

    def _fit(self, start: int, target: int, head: str) -> str:
        # Decoding a window and re-encoding it need not give the same count (merges across
        # the cut, stripped spaces, the join with the head): move the window's end by the
        # error until it is exact, and if that oscillates, pad the best short text instead.
        end = start + max(target - self._count(head), 0)
        tried: set[int] = set()
        below: tuple[str, int] | None = None
        while end not in tried and len(tried) < _MAX_FIXUPS:
            tried.add(end)
            text = head + self._tokenizer.decode(self._ids[start:end]).strip()
            got = self._count(text)
            if got == target:
                return text
            if got < target and (below is None or got > below[1]):
                below = (text, got)
            end = max(start, end + target - got)
        text, got = below if below is not None else (head, self._count(head))
        while got < target:
            word = next((w for w in _PAD_WORDS if self._count(text + w) == got + 1), None)
            if word is None:
                break
            text, got = text + word, got + 1
        if got != target:
            raise DatasetError(f"this tokenizer cannot make a prompt of exactly {target} tokens")
        return text

    def _count(self, text: str) -> int:
        return len(self._tokenizer.encode(text, add_special_tokens=False).ids) if text else 0


@cache
def _shipped_texts() -> tuple[str, ...]:
    """The shipped chat prompts, read once (also the synthetic prompts' source text)."""
    data = resources.files("bench.harness").joinpath("data/chat_prompts.jsonl")
    texts = []
    for number, line in enumerate(data.read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip():
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
                raise DatasetError(f"{data} line {number}: expected {{'prompt': str}}")
            texts.append(record["prompt"])
    return tuple(texts)


def _invalid(kind: str, params: tuple[float, ...]) -> str | None:
    """Why these parameters make no distribution, or None when they do."""
    if kind not in _ARITY or len(params) != _ARITY[kind]:
        return "unknown form"
    if not all(math.isfinite(param) and param > 0 for param in params):
        return "parameters must be positive"
    if kind in ("fixed", "uniform") and not all(param.is_integer() for param in params):
        return "fixed and uniform take whole numbers"
    if kind == "uniform" and params[0] > params[1]:
        return "MIN must not exceed MAX"
    return None


def _bad_spec(spec: str, why: str) -> str:
    return f"bad length distribution {spec!r} ({why}); accepted forms: {_FORMS}"


def _number(value: float) -> str:
    return str(int(value)) if value.is_integer() else repr(value)
