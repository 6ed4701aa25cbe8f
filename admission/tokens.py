"""Token estimates made before admission: what a request may cost at most.

The prompt is counted with the served model's own tokenizer (its ``tokenizer.json``, through
HF ``tokenizers``: exact for the text, a few tokens short of the chat template). ``tiktoken`` was
the other candidate; its encodings download from a blob store at first use, which a gateway
in a closed network cannot reach, and it counts another model's tokens. Without a tokenizer
file the estimate falls back to 4 characters per token. Reconciliation against the engine's
usage corrects whatever the estimate got wrong. The same prompt count decides whether the
request is split across a prefill and a decode worker (``kv_transfer.decider``).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from tokenizers import Tokenizer

from core.messages import Endpoint
from core.prompt import Prompt, TokenEstimate

log = logging.getLogger("tandem.admission")

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


class TokenCounters:
    """Each model folder's tokenizer, loaded once and off the event loop: every version counts
    its prompts with its own (versions may differ in their tokenizers)."""

    def __init__(self, default: TokenCounter, default_dir: Path | None = None) -> None:
        """``default`` counts for a model without a folder (external workers); it is
        ``default_dir``'s tokenizer, when it has one (not loaded a second time)."""
        self._default = default
        self._by_dir: dict[Path, TokenCounter] = {}
        if default_dir is not None:
            self._by_dir[default_dir] = default

    async def for_dir(self, model_dir: Path | None) -> TokenCounter:
        """The counter of ``model_dir``'s tokenizer (the character estimate without one)."""
        if model_dir is None:
            return self._default
        counter = self._by_dir.get(model_dir)
        if counter is None:
            # Two first requests may both load it: the same tokenizer, one kept.
            try:
                loaded = await asyncio.to_thread(TokenizerCounter.for_model, model_dir)
            except Exception as exc:  # noqa: BLE001 - the tokenizers library raises a bare Exception
                # An estimate, not an answer: a tokenizer it cannot read must not fail requests.
                log.error("cannot read %s/tokenizer.json (%s); counting 4 characters a token",
                          model_dir, exc)  # fmt: skip
                loaded = CharCounter()
            counter = self._by_dir.setdefault(model_dir, loaded)
        return counter


class CharCounter:
    """Four characters per token: the usual rule of thumb for English."""

    def count(self, text: str) -> int:
        return math.ceil(len(text) / 4)


async def estimate_tokens(
    endpoint: Endpoint,
    body: dict[str, Any],
    prompt: Prompt,
    counter: TokenCounter,
    max_model_len: int | None,
) -> TokenEstimate:
    """Estimate a validated request body's tokens: ``prompt`` (read from ``body``) counted
    with ``counter`` (long prompts off the loop), and the output ``body`` caps."""
    if sum(len(text) for text in prompt.texts) > _INLINE_CHARS:
        prompt_tokens = await asyncio.to_thread(_count_all, counter, prompt.texts)
    else:
        prompt_tokens = _count_all(counter, prompt.texts)
    prompt_tokens += prompt.num_literal_tokens
    if endpoint is Endpoint.CHAT:
        prompt_tokens += _TOKENS_PER_MESSAGE * prompt.num_messages + _TOKENS_REPLY_PRIMING
    return TokenEstimate(
        prompt_tokens=prompt_tokens,
        max_output_tokens=requested_max_tokens(endpoint, body, prompt_tokens, max_model_len),
        num_choices=int(body.get("n") or 1),
        output_param=output_param(body),
        prompt_param=prompt.param,
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


def _count_all(counter: TokenCounter, texts: Sequence[str]) -> int:
    return sum(counter.count(text) for text in texts)
