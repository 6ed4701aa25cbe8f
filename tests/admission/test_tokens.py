"""Token estimates: the parsed prompt counted, plus the output the request may ask for."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from admission.tokens import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    CharCounter,
    TokenCounters,
    TokenizerCounter,
    estimate_tokens,
)
from core.messages import Endpoint
from core.prompt import Prompt, TokenEstimate


class Words:
    """A counter with known answers: one token per word."""

    def count(self, text: str) -> int:
        return len(text.split())


async def estimate(
    endpoint: Endpoint, body: dict[str, Any], max_model_len: int | None = None
) -> TokenEstimate:
    body = {"model": "m", **body}
    return await estimate_tokens(
        endpoint, body, Prompt.parse(endpoint, body), Words(), max_model_len
    )


async def test_chat_counts_texts_and_the_template() -> None:
    body = {
        "messages": [
            {"role": "system", "content": "two words"},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "three more words"},
                    {"type": "image_url", "image_url": {"url": "https://x/i.png"}},
                ],
            },
        ],
    }
    result = await estimate(Endpoint.CHAT, body, max_model_len=100)
    assert result.prompt_tokens == 5 + 2 * 4 + 3  # texts, per message, reply priming
    assert result.max_output_tokens == 100 - result.prompt_tokens  # what the window leaves
    assert (result.prompt_param, result.output_param, result.num_choices) == (
        "messages",
        "max_tokens",
        1,
    )


@pytest.mark.parametrize(
    ("prompt", "tokens"),
    [
        ("one two three", 3),
        (["one two", "three four", "five"], 5),  # every entry counts: the sum
        ([5, 6, 7, 8], 4),
        ([[1, 2], [3, 4, 5]], 5),
    ],
)
async def test_completions_prompts(prompt: Any, tokens: int) -> None:
    result = await estimate(Endpoint.COMPLETIONS, {"prompt": prompt, "n": 2})
    assert result.prompt_tokens == tokens
    assert result.prompt_param == "prompt"
    assert result.max_output_tokens == COMPLETIONS_DEFAULT_MAX_TOKENS
    assert result.total_tokens == tokens + 2 * COMPLETIONS_DEFAULT_MAX_TOKENS


async def test_output_cap_is_the_clients() -> None:
    result = await estimate(
        Endpoint.CHAT,
        {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 7},
    )
    assert (result.max_output_tokens, result.output_param) == (7, "max_completion_tokens")


async def test_long_prompts_count_the_same_off_the_loop() -> None:
    long = "word " * 5_000  # past the inline limit: counted in a thread
    result = await estimate(Endpoint.COMPLETIONS, {"prompt": [long, "x"]})
    assert result.prompt_tokens == 5_001


def test_counters(tmp_path: Path) -> None:
    assert CharCounter().count("abcde") == 2
    assert isinstance(TokenizerCounter.for_model(tmp_path), CharCounter)
    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    assert TokenizerCounter.for_model(tmp_path).count("a b c") == 3


async def test_each_model_folder_counts_with_its_own_tokenizer(tmp_path: Path) -> None:
    words, chars = tmp_path / "words", tmp_path / "chars"
    words.mkdir()
    chars.mkdir()  # no tokenizer.json: the character estimate
    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(words / "tokenizer.json"))
    counters = TokenCounters(Words())
    text = "one two three four five six seven eight"  # 8 words, 40 characters
    assert (await counters.for_dir(words)).count(text) == 8
    assert (await counters.for_dir(chars)).count(text) == 10
    assert (await counters.for_dir(None)).count(text) == 8  # the default
    assert await counters.for_dir(words) is await counters.for_dir(words)  # loaded once
    default = Words()
    assert await TokenCounters(default, chars).for_dir(chars) is default  # not loaded again


async def test_an_unreadable_tokenizer_falls_back_to_the_character_estimate(
    tmp_path: Path,
) -> None:
    (tmp_path / "tokenizer.json").write_text('{"model": {"vocab": {}}}')  # not a tokenizer
    counter = await TokenCounters(Words()).for_dir(tmp_path)
    assert counter.count("abcdefgh") == 2
