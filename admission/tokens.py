"""Token estimates made before admission: what a request may cost at most.

The prompt is counted with the served model's own tokenizer (its ``tokenizer.json``, through
HF ``tokenizers``: exact for the text), and a chat conversation is priced what the model's
chat template adds to it (``admission.chat_template``, measured as the tokenizer loads), with
its tools and the tool calls in its history.
``tiktoken`` was the other candidate; its encodings download from a blob store at first use,
which a gateway in a closed network cannot reach, and it counts another model's tokens.
Without a tokenizer file the estimate falls back to 4 characters per token. Reconciliation
against the engine's usage corrects whatever the estimate got wrong. The same prompt count
decides whether the request is split across a prefill and a decode worker
(``kv_transfer.decider``).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import orjson
from tokenizers import Tokenizer

from admission.chat_template import ChatTemplate, measure
from core.messages import Endpoint
from core.prompt import Prompt, TokenEstimate

log = logging.getLogger("tandem.admission")

# Past this many characters still to count, counting moves off the loop. The bundled model's
# tokenizer takes about 0.2 us a character of prose (bench/token_counting.py) and a thread hop
# about 30 us of the loop's CPU: the loop stalls for at most about 0.4 ms, and a hop costs
# less than a tenth of the counting it moves.
INLINE_CHARS = 2_000
_TOOLS_KEY = "\x00tools:"
"""Prefixes the JSON of a request's tools where their count is kept, apart from the texts'."""
_TOOL_CALLS_KEY = "\x00tool_calls:"
"""Prefixes the JSON of one assistant message's tool calls where their count is kept."""
_MEMO_ENTRIES = 16_384
"""Texts whose counts a tokenizer counter keeps (about 200 bytes each: no text is kept)."""
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
"""OpenAI's default ``max_tokens`` for ``/v1/completions``."""


class TokenCounter(Protocol):
    """Counts the tokens of a text."""

    template: ChatTemplate
    """What the model's chat template adds to a conversation."""

    def count(self, text: str) -> int:
        """Tokens in ``text``, without special tokens. Safe to call from a thread: long
        prompts are counted off the event loop."""
        ...

    def known(self, text: str) -> int | None:
        """The count of ``text`` if it is at hand without counting, else None. The event
        loop's thread only."""
        ...

    def remember(self, text: str, tokens: int) -> None:
        """Keep ``count(text)`` for ``known``. The event loop's thread only."""
        ...


class TokenizerCounter:
    """The served model's tokenizer, with the counts of recent texts kept.

    A chat request sends its whole conversation again at every turn, and most requests of an
    application share its system prompt: the counts of the texts seen lately (each message's
    text, each prompt) make a turn's cost its new message's. They are kept by the text's hash
    (Python's keyed SipHash, 64 bits), so no text outlives its request. Two texts of one hash
    would share a count, an estimate that settling against the engine's usage corrects; at
    ``_MEMO_ENTRIES`` texts kept, a new text has about one chance in 10^15 of it.
    """

    def __init__(self, tokenizer_file: Path) -> None:
        self._tokenizer = Tokenizer.from_file(str(tokenizer_file))
        self._memo: OrderedDict[int, int] = OrderedDict()  # hash -> tokens, oldest use first
        self.template = ChatTemplate.generic(self.count)

    @classmethod
    def for_model(cls, model_dir: Path | None) -> TokenCounter:
        """The model folder's tokenizer and chat template, or the character estimate when it
        has no tokenizer."""
        if model_dir is None or not (model_dir / "tokenizer.json").is_file():
            return CharCounter()
        counter = cls(model_dir / "tokenizer.json")
        counter.template = measure(model_dir, counter.count)
        return counter

    def count(self, text: str) -> int:
        # The batch call's fast form computes no offsets (12-20 % less time than ``encode``
        # on prose) and lets go of the GIL while it tokenizes (a thread counting a long
        # prompt does not hold up the loop).
        encoded = self._tokenizer.encode_batch_fast([text], add_special_tokens=False)
        return len(encoded[0].ids)

    def known(self, text: str) -> int | None:
        key = hash(text)
        tokens = self._memo.get(key)
        if tokens is not None:
            self._memo.move_to_end(key)
        return tokens

    def remember(self, text: str, tokens: int) -> None:
        self._memo[hash(text)] = tokens
        if len(self._memo) > _MEMO_ENTRIES:
            self._memo.popitem(last=False)


class TokenCounters:
    """Each model folder's tokenizer, loaded once and off the event loop: every version counts
    its prompts with its own (versions may differ in their tokenizers).

    A load takes about 90 ms for SmolLM2's tokenizer (its vocabulary, and the chat template
    measured). The gateway loads a version's before it takes traffic (at start, and as the
    admin API deploys one: ``load``), so a rollout's candidate is not judged on its first
    requests waiting for it; a request for a folder not loaded yet waits for the one load
    under way, never starts another."""

    def __init__(self, default: TokenCounter, default_dir: Path | None = None) -> None:
        """``default`` counts for a model without a folder (external workers); it is
        ``default_dir``'s tokenizer, when it has one (not loaded a second time)."""
        self._default = default
        self._by_dir: dict[Path, TokenCounter] = {}
        self._loading: dict[Path, asyncio.Future[TokenCounter]] = {}
        if default_dir is not None:
            self._by_dir[default_dir] = default

    async def for_dir(self, model_dir: Path | None) -> TokenCounter:
        """The counter of ``model_dir``'s tokenizer (the character estimate without one)."""
        if model_dir is None:
            return self._default
        counter = self._by_dir.get(model_dir)
        if counter is not None:
            return counter
        loading = self._loading.get(model_dir)
        if loading is None:
            loading = asyncio.ensure_future(self._load(model_dir))
            self._loading[model_dir] = loading
        # Shielded: one waiter's client leaving must not cancel the load the others share.
        return await asyncio.shield(loading)

    async def load(self, model_dir: Path | None) -> None:
        """Load ``model_dir``'s tokenizer now, if it is not loaded (a version about to be
        served)."""
        await self.for_dir(model_dir)

    async def _load(self, model_dir: Path) -> TokenCounter:
        try:
            loaded: TokenCounter = await asyncio.to_thread(TokenizerCounter.for_model, model_dir)
        except Exception as exc:  # noqa: BLE001 - the tokenizers library raises a bare Exception
            # An estimate, not an answer: a tokenizer it cannot read must not fail requests.
            log.error("cannot read %s/tokenizer.json (%s); counting 4 characters a token",
                      model_dir, exc)  # fmt: skip
            loaded = CharCounter()
        finally:
            del self._loading[model_dir]
        self._by_dir[model_dir] = loaded
        return loaded


class CharCounter:
    """Four characters per token: the usual rule of thumb for English."""

    def __init__(self) -> None:
        self.template = ChatTemplate.generic(self.count)

    def count(self, text: str) -> int:
        return math.ceil(len(text) / 4)

    def known(self, text: str) -> int | None:
        return self.count(text)  # as cheap as a lookup

    def remember(self, text: str, tokens: int) -> None:
        pass


async def estimate_tokens(
    endpoint: Endpoint,
    body: dict[str, Any],
    prompt: Prompt,
    counter: TokenCounter,
    max_model_len: int | None,
) -> TokenEstimate:
    """Estimate a validated request body's tokens: ``prompt`` (read from ``body``) counted
    with ``counter`` (long prompts off the loop), and the output ``body`` caps."""
    prompt_tokens = await count_texts(counter, prompt.texts)
    prompt_tokens += prompt.num_literal_tokens
    if endpoint is Endpoint.CHAT:
        prompt_tokens += counter.template.cost.of(prompt.num_messages, prompt.led_by_system)
        tools = body.get("tools")
        if isinstance(tools, list) and tools:
            template = counter.template
            prompt_tokens += await _priced(counter, _TOOLS_KEY, tools, template.tools_tokens)
        prompt_tokens += await _tool_calls_tokens(counter, prompt.raw)
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


async def count_texts(counter: TokenCounter, texts: Sequence[str]) -> int:
    """The tokens of ``texts`` together: those ``counter`` knows looked up, the others counted
    (in a thread past ``INLINE_CHARS`` characters) and remembered."""
    total = 0
    unknown: list[str] = []
    for text in texts:
        tokens = counter.known(text)
        if tokens is None:
            unknown.append(text)
        else:
            total += tokens
    if not unknown:
        return total
    if sum(len(text) for text in unknown) > INLINE_CHARS:
        counts = await asyncio.to_thread(_count_each, counter, unknown)
    else:
        counts = _count_each(counter, unknown)
    for text, tokens in zip(unknown, counts, strict=True):
        counter.remember(text, tokens)
    return total + sum(counts)


async def _tool_calls_tokens(counter: TokenCounter, messages: Any) -> int:
    """What the tool calls of a chat's assistant messages add (``ChatTemplate.
    tool_calls_tokens``), each message's kept: a conversation sends them again every turn."""
    if not isinstance(messages, list):
        return 0
    total = 0
    for message in messages:
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        if isinstance(calls, list) and calls and message.get("role") == "assistant":
            price = counter.template.tool_calls_tokens
            total += await _priced(counter, _TOOL_CALLS_KEY, calls, price)
    return total


async def _priced(
    counter: TokenCounter, kind: str, value: list[Any], price: Callable[[list[Any]], int]
) -> int:
    """``price(value)``, kept in the counter's memo under ``kind`` and ``value``'s JSON like a
    text's count (the same tools and history come again); off the loop when long."""
    key = kind + orjson.dumps(value).decode()
    tokens = counter.known(key)
    if tokens is None:
        if len(key) > INLINE_CHARS:
            tokens = await asyncio.to_thread(price, value)
        else:
            tokens = price(value)
        counter.remember(key, tokens)
    return tokens


def _count_each(counter: TokenCounter, texts: Sequence[str]) -> list[int]:
    return [counter.count(text) for text in texts]
