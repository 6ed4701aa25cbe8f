"""Token estimates: the parsed prompt counted, plus the output the request may ask for."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from admission import tokens
from admission.chat_template import GENERIC, ChatTemplate, ChatTemplateCost
from admission.tokens import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    CharCounter,
    TokenCounter,
    TokenCounters,
    TokenizerCounter,
    estimate_tokens,
)
from core.messages import Endpoint
from core.prompt import Prompt, TokenEstimate


class Words:
    """A counter with known answers: one token per word. It notes what it counted and on
    which threads, and remembers what it is told to."""

    def __init__(self, cost: ChatTemplateCost = GENERIC) -> None:
        self.template = ChatTemplate(cost, self.count)
        self.counted: list[str] = []
        self.threads: set[int] = set()
        self.remembered: dict[str, int] = {}

    def count(self, text: str) -> int:
        self.counted.append(text)
        self.threads.add(threading.get_ident())
        return len(text.split())

    def known(self, text: str) -> int | None:
        return self.remembered.get(text)

    def remember(self, text: str, tokens: int) -> None:
        self.remembered[text] = tokens


async def estimate(
    endpoint: Endpoint,
    body: dict[str, Any],
    max_model_len: int | None = None,
    counter: Words | None = None,
) -> TokenEstimate:
    body = {"model": "m", **body}
    return await estimate_tokens(
        endpoint, body, Prompt.parse(endpoint, body), counter or Words(), max_model_len
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


@pytest.mark.parametrize(("first_role", "added"), [("system", 2 * 5 + 3), ("user", 2 * 5 + 20)])
async def test_chat_is_priced_with_the_counters_template(first_role: str, added: int) -> None:
    messages = [{"role": first_role, "content": "two words"}, {"role": "user", "content": "one"}]
    counter = Words(ChatTemplateCost(per_message=5, fixed=20, fixed_after_system=3))
    result = await estimate(Endpoint.CHAT, {"messages": messages}, counter=counter)
    assert result.prompt_tokens == 3 + added


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
    loop_thread = threading.get_ident()
    short = Words()
    result = await estimate(Endpoint.COMPLETIONS, {"prompt": ["word " * 100]}, counter=short)
    assert (result.prompt_tokens, short.threads) == (100, {loop_thread})
    long = Words()
    text = "word " * (tokens.INLINE_CHARS // 5 + 1)  # past the inline limit: in a thread
    result = await estimate(Endpoint.COMPLETIONS, {"prompt": [text, "x"]}, counter=long)
    assert result.prompt_tokens == tokens.INLINE_CHARS // 5 + 2
    assert long.threads and loop_thread not in long.threads


async def test_a_conversations_next_turn_counts_only_its_new_text() -> None:
    counter = Words()
    history = [
        {"role": "system", "content": "you answer briefly"},
        {"role": "user", "content": "the first question"},
        {"role": "assistant", "content": "the first answer"},
    ]
    first = await estimate(Endpoint.CHAT, {"messages": history}, counter=counter)
    turn = [*history, {"role": "user", "content": "and a second question"}]
    counter.counted.clear()
    second = await estimate(Endpoint.CHAT, {"messages": turn}, counter=counter)
    assert counter.counted == ["and a second question"]
    assert second.prompt_tokens == first.prompt_tokens + 4 + 4  # its words, one more message


async def test_only_what_is_left_to_count_decides_the_thread_hop() -> None:
    counter = Words()
    long = "word " * (tokens.INLINE_CHARS // 5 + 1)
    await estimate(Endpoint.COMPLETIONS, {"prompt": long}, counter=counter)
    counter.threads.clear()
    result = await estimate(Endpoint.COMPLETIONS, {"prompt": [long, "two words"]}, counter=counter)
    assert result.prompt_tokens == tokens.INLINE_CHARS // 5 + 3
    assert counter.threads == {threading.get_ident()}  # the long one was known


def test_counters(tmp_path: Path) -> None:
    assert CharCounter().count("abcde") == 2
    assert isinstance(TokenizerCounter.for_model(tmp_path), CharCounter)
    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    assert TokenizerCounter.for_model(tmp_path).count("a b c") == 3


def test_the_tokenizer_counts_what_encode_counts(tmp_path: Path) -> None:
    """The counter's fast form (no offsets) gives ``encode``'s count, on a byte-level BPE
    like the bundled model's."""
    corpus = ["The quick brown fox jumps over the lazy dog.", "Grüße aus Köln! 東京 🙂", "x = 1"]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.train_from_iterator(corpus * 20, trainers.BpeTrainer(vocab_size=300))
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    counter = TokenizerCounter(tmp_path / "tokenizer.json")
    for text in [*corpus, "an unseen sentence, with ümlauts and 日本語", "", " " * 7]:
        assert counter.count(text) == len(tokenizer.encode(text, add_special_tokens=False).ids)


def test_the_tokenizer_keeps_the_counts_of_recent_texts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tokens, "_MEMO_ENTRIES", 2)
    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    counter = TokenizerCounter(tmp_path / "tokenizer.json")
    assert counter.known("a b") is None
    counter.remember("a b", 2)
    counter.remember("c d e", 3)
    assert (counter.known("a b"), counter.known("c d e")) == (2, 3)
    assert counter.known("a b") == 2  # now the most recently used
    counter.remember("f", 1)  # one past the bound: the least recently used goes
    assert (counter.known("a b"), counter.known("c d e"), counter.known("f")) == (2, None, 1)


def test_the_character_estimate_is_always_at_hand() -> None:
    counter = CharCounter()
    assert counter.known("abcdefghi") == 3
    counter.remember("abcdefghi", 99)  # nothing to keep: it is not a lookup
    assert counter.known("abcdefghi") == 3


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


async def test_first_requests_for_a_folder_share_one_load_and_a_loaded_one_waits_for_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    first, deployed = tmp_path / "first", tmp_path / "deployed"
    for folder in (first, deployed):
        folder.mkdir()
        tokenizer.save(str(folder / "tokenizer.json"))
    loads: list[Path] = []
    for_model = TokenizerCounter.for_model

    def counted(model_dir: Path) -> TokenCounter:
        loads.append(model_dir)
        return for_model(model_dir)

    monkeypatch.setattr(TokenizerCounter, "for_model", staticmethod(counted))
    counters = TokenCounters(Words())
    together = await asyncio.gather(*(counters.for_dir(first) for _ in range(4)))
    assert loads == [first] and all(counter is together[0] for counter in together)

    await counters.load(deployed)  # as a version is deployed, before its traffic
    assert loads == [first, deployed]
    assert (await counters.for_dir(deployed)).count("a b c") == 3
    assert loads == [first, deployed]  # its requests loaded nothing
