"""Token estimates made before admission: what a request may cost at most.

The prompt is counted with the served model's own tokenizer (its ``tokenizer.json``, through
HF ``tokenizers``: exact for the text, a few tokens short of the chat template). ``tiktoken`` was
the other candidate; its encodings download from a blob store at first use, which a gateway
in a closed network cannot reach, and it counts another model's tokens. Without a tokenizer
file the estimate falls back to 4 characters per token. Reconciliation against the engine's
usage corrects whatever the estimate got wrong.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from tokenizers import Tokenizer

from core.messages import Endpoint

# The chat template wraps each message (``<|im_start|>role\n ... <|im_end|>\n`` and the like)
# and primes the reply; OpenAI's own cookbook counts 3-4 tokens per message plus 3.
_TOKENS_PER_MESSAGE = 4
_TOKENS_REPLY_PRIMING = 3
# Below this many characters tokenizing takes microseconds: not worth a thread hop.
_INLINE_CHARS = 8_000
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
"""OpenAI's default ``max_tokens`` for ``/v1/completions``."""


class TokenCounter(Protocol):
    """Counts the tokens of a text."""

    def count(self, text: str) -> int:
        """Tokens in ``text``, without special tokens."""
        ...


class TokenizerCounter:
    """The served model's tokenizer."""

    def __init__(self, tokenizer_file: Path) -> None:
        self._tokenizer = Tokenizer.from_file(str(tokenizer_file))

    @classmethod
    def for_model(cls, model_dir: Path | None) -> TokenCounter:
        """The model folder's tokenizer, or the character estimate when it has none."""
        if model_dir is not None and (model_dir / "tokenizer.json").is_file():
            return cls(model_dir / "tokenizer.json")
        return CharCounter()

    def count(self, text: str) -> int:
        return len(self._tokenizer.encode(text, add_special_tokens=False).ids)


class CharCounter:
    """Four characters per token: the usual rule of thumb for English."""

    def count(self, text: str) -> int:
        return math.ceil(len(text) / 4)


@dataclass(frozen=True, slots=True)
class TokenEstimate:
    """The most a request can cost, as reserved against the tenant's TPM."""

    prompt_tokens: int
    max_output_tokens: int
    """Per choice: the client's ``max_tokens`` or what the context window leaves."""
    num_choices: int
    output_param: str = "max_tokens"
    """The request's name for its output cap (``max_tokens`` or ``max_completion_tokens``),
    so an error names the field the client actually sent."""
    prompt_param: str = "messages"
    """The request's name for its prompt (``messages``, or ``prompt`` for completions)."""

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.max_output_tokens * self.num_choices


async def estimate_tokens(
    endpoint: Endpoint, body: dict[str, Any], counter: TokenCounter, max_model_len: int | None
) -> TokenEstimate:
    """Estimate a validated request body's tokens (long prompts are counted off the loop)."""
    texts, num_literal_tokens = _prompt_parts(endpoint, body)
    if sum(len(text) for text in texts) > _INLINE_CHARS:
        prompt = await asyncio.to_thread(_count_all, counter, texts)
    else:
        prompt = _count_all(counter, texts)
    prompt += num_literal_tokens
    if endpoint is Endpoint.CHAT:
        prompt += _TOKENS_PER_MESSAGE * len(body.get("messages") or []) + _TOKENS_REPLY_PRIMING
    return TokenEstimate(
        prompt_tokens=prompt,
        max_output_tokens=requested_max_tokens(endpoint, body, prompt, max_model_len),
        num_choices=int(body.get("n") or 1),
        output_param=output_param(body),
        prompt_param="messages" if endpoint is Endpoint.CHAT else "prompt",
    )


def output_param(body: dict[str, Any]) -> str:
    """The field a request caps its output with (``max_completion_tokens`` wins when set)."""
    return "max_completion_tokens" if body.get("max_completion_tokens") else "max_tokens"


def requested_max_tokens(
    endpoint: Endpoint, body: dict[str, Any], prompt_tokens: int, max_model_len: int | None
) -> int:
    """The output cap per choice: the client's, else the endpoint's default, else the window."""
    explicit = body.get(output_param(body))
    if explicit is not None:
        return int(explicit)
    if endpoint is Endpoint.COMPLETIONS:
        return COMPLETIONS_DEFAULT_MAX_TOKENS
    if max_model_len is None:
        # Unknown window (external workers that did not say): assume a common 4k one.
        return 4096
    return max(1, max_model_len - prompt_tokens)


def _count_all(counter: TokenCounter, texts: list[str]) -> int:
    return sum(counter.count(text) for text in texts)


def _prompt_parts(endpoint: Endpoint, body: dict[str, Any]) -> tuple[list[str], int]:
    """The prompt's texts, and the number of tokens given literally as token ids."""
    if endpoint is Endpoint.CHAT:
        texts: list[str] = []
        for message in body.get("messages") or []:
            texts.extend(_content_texts(message.get("content")))
        return texts, 0
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [prompt], 0
    if isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
        return [], len(prompt)
    if isinstance(prompt, list):
        strings = [p for p in prompt if isinstance(p, str)]
        literal = sum(len(p) for p in prompt if isinstance(p, list))
        return strings, literal
    return [], 0


def _content_texts(content: object) -> list[str]:
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        # Content parts: only text parts carry prompt tokens the gateway can count.
        return [
            part["text"]
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        ]
    return []
