"""A chat template's price, measured by rendering it: the texts plus that price are what the
whole rendered conversation counts."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from admission.chat_template import GENERIC, ChatTemplateCost, measure
from admission.tokens import TokenCounter, TokenizerCounter, estimate_tokens
from core.messages import Endpoint
from core.prompt import Prompt

# ChatML with a default system message, as the bundled SmolLM2's (``loop.first`` and all).
CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def model_folder(path: Path, config: Mapping[str, object], jinja: str | None = None) -> Path:
    """A word-level tokenizer (a token a word, markers one token each) and ``config``."""
    tokenizer = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(["<|im_start|>", "<|im_end|>", "<s>"])
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja is not None:
        (path / "chat_template.jinja").write_text(jinja)
    return path


CONVERSATIONS = [
    [{"role": "user", "content": "name one colour"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "name one colour"}],
    [
        {"role": "user", "content": "name one colour"},
        {"role": "assistant", "content": "red"},
        {"role": "user", "content": "and another one"},
    ],
]


@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["user", "system-led", "three-turns"])
async def test_an_estimate_counts_what_the_engine_renders(
    tmp_path: Path, messages: list[dict[str, str]]
) -> None:
    folder = model_folder(tmp_path, {"chat_template": CHATML})
    counter = TokenizerCounter.for_model(folder)
    assert counter.template.cost == ChatTemplateCost(per_message=3, fixed=10, fixed_after_system=2)
    body = {"model": "m", "messages": messages}
    estimate = await estimate_tokens(
        Endpoint.CHAT, body, Prompt.parse(Endpoint.CHAT, body), counter, None
    )
    # What the engine counts: the template rendered around the real texts.
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    rendered = "".join(
        (
            "<|im_start|>system\nYou are a helpful assistant<|im_end|>\n"
            if i == 0 and m["role"] != "system"
            else ""
        )
        + f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n"
        for i, m in enumerate(messages)
    )
    rendered += "<|im_start|>assistant\n"
    assert estimate.prompt_tokens == len(tokenizer.encode(rendered).ids)


# Tools as Qwen's and Hermes' templates render them: each one's JSON in a system message.
CHATML_TOOLS = (
    "{% if tools %}{{ '<|im_start|>system\\nTools:' }}"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}"
    "{{ '<|im_end|>\\n' }}{% endif %}" + CHATML
)
TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "time", "description": "now, in a city"}},
]


async def estimate_of(counter: TokenCounter, messages: list[Any], tools: list[Any]) -> int:
    body = {"model": "m", "messages": messages, "tools": tools}
    prompt = Prompt.parse(Endpoint.CHAT, body)
    return (await estimate_tokens(Endpoint.CHAT, body, prompt, counter, None)).prompt_tokens


def calls_of(monkeypatch: pytest.MonkeyPatch, owner: object, name: str) -> list[Any]:
    """The argument of each call of ``owner.name`` from now on (it still runs)."""
    calls: list[Any] = []
    original = getattr(owner, name)

    def recorded(value: Any) -> Any:
        calls.append(value)
        return original(value)

    monkeypatch.setattr(owner, name, recorded)
    return calls


async def test_tools_are_priced_as_the_template_renders_them(tmp_path: Path) -> None:
    folder = model_folder(tmp_path, {"chat_template": CHATML_TOOLS})
    counter = TokenizerCounter.for_model(folder)
    messages = CONVERSATIONS[0]
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tool_lines = "".join("\n" + json.dumps(tool) for tool in TOOLS)
    rendered = (
        f"<|im_start|>system\nTools:{tool_lines}<|im_end|>\n"
        "<|im_start|>system\nYou are a helpful assistant<|im_end|>\n"
        "<|im_start|>user\nname one colour<|im_end|>\n<|im_start|>assistant\n"
    )
    assert await estimate_of(counter, messages, TOOLS) == len(tokenizer.encode(rendered).ids)


async def test_a_template_passing_arguments_to_tojson_renders_as_in_transformers(
    tmp_path: Path,
) -> None:
    template = (
        "{% if tools %}Tools here: {{ tools | tojson(ensure_ascii=True, indent=2) }}{% endif %}"
    )
    counter = TokenizerCounter.for_model(model_folder(tmp_path, {"chat_template": template}))
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    rendered = "Tools here: " + json.dumps(TOOLS, ensure_ascii=True, indent=2)
    assert counter.template.tools_tokens(TOOLS) == len(tokenizer.encode(rendered).ids)


async def test_tools_a_template_leaves_out_add_nothing_and_are_counted_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    counter = TokenizerCounter.for_model(model_folder(tmp_path, {"chat_template": CHATML}))
    without = await estimate_of(counter, CONVERSATIONS[0], [])
    renders = calls_of(monkeypatch, counter.template, "tools_tokens")
    assert await estimate_of(counter, CONVERSATIONS[0], TOOLS) == without
    led = CONVERSATIONS[1]
    assert await estimate_of(counter, led, TOOLS) == await estimate_of(counter, led, [])
    assert renders == [TOOLS]  # the same tools again: their count was kept


async def test_without_a_template_tools_are_priced_as_their_json(tmp_path: Path) -> None:
    counter = TokenizerCounter.for_model(model_folder(tmp_path, {}))
    without = await estimate_of(counter, CONVERSATIONS[0], [])
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    json_tokens = len(tokenizer.encode(json.dumps(TOOLS)).ids)
    assert await estimate_of(counter, CONVERSATIONS[0], TOOLS) == without + json_tokens


# Tool calls as Hermes' template writes them: after the content, each call's name and its
# arguments as JSON (vLLM parses them to an object first).
CHATML_CALLS = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') }}"
    "{% for call in message.tool_calls or [] %}"
    "{{ '<tool_call> ' + call.function.name + ' ' + call.function.arguments | tojson }}"
    "{{ ' </tool_call>' }}{% endfor %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CALLS = [
    {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Paris"}'}},
    {"id": "c2", "type": "function", "function": {"name": "time", "arguments": ""}},
]  # fmt: skip
HISTORY = [
    {"role": "user", "content": "weather and time in Paris"},
    {"role": "assistant", "content": None, "tool_calls": CALLS},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "c2", "content": "noon"},
    {"role": "user", "content": "so?"},
]


async def test_tool_calls_in_the_history_are_priced_as_the_template_renders_them(
    tmp_path: Path,
) -> None:
    counter = TokenizerCounter.for_model(model_folder(tmp_path, {"chat_template": CHATML_CALLS}))
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    calls = '<tool_call> weather {"city": "Paris"} </tool_call><tool_call> time {} </tool_call>'
    rendered = (
        "<|im_start|>system\nYou are a helpful assistant<|im_end|>\n"
        "<|im_start|>user\nweather and time in Paris<|im_end|>\n"
        f"<|im_start|>assistant\n{calls}<|im_end|>\n"
        "<|im_start|>tool\nsunny<|im_end|>\n<|im_start|>tool\nnoon<|im_end|>\n"
        "<|im_start|>user\nso?<|im_end|>\n<|im_start|>assistant\n"
    )
    # Exact: the arguments string priced as written would be a token short ('{"city":"Paris"}').
    assert await estimate_of(counter, HISTORY, []) == len(tokenizer.encode(rendered).ids)


async def test_a_messages_tool_calls_are_rendered_once_across_turns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    counter = TokenizerCounter.for_model(model_folder(tmp_path, {"chat_template": CHATML_CALLS}))
    renders = calls_of(monkeypatch, counter.template, "tool_calls_tokens")
    first = await estimate_of(counter, HISTORY, [])
    later = [*HISTORY, {"role": "assistant", "content": "sunny, noon"}, HISTORY[-1]]
    assert await estimate_of(counter, later, []) > first
    assert renders == [CALLS]  # the next turn sends the same calls again: their count was kept


@pytest.mark.parametrize(
    ("config", "calls"),
    [
        ({}, CALLS),  # no template
        ({"chat_template": CHATML_CALLS}, [{"type": "function"}]),  # a call it cannot render
    ],
    ids=["no-template", "unrenderable"],
)
async def test_tool_calls_it_cannot_render_are_priced_as_their_json(
    tmp_path: Path, config: dict[str, Any], calls: list[Any]
) -> None:
    counter = TokenizerCounter.for_model(model_folder(tmp_path, config))
    tokenizer = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    history = [HISTORY[0], {"role": "assistant", "content": "", "tool_calls": calls}]
    without = [HISTORY[0], {"role": "assistant", "content": ""}]
    json_tokens = len(tokenizer.encode(json.dumps(calls)).ids)
    assert await estimate_of(counter, history, []) == await estimate_of(counter, without, []) + (
        json_tokens
    )


def test_the_jinja_file_wins_and_special_tokens_are_variables(tmp_path: Path) -> None:
    config = {"chat_template": "{{ raise_exception('not this one') }}", "bos_token": "<s>"}
    folder = model_folder(tmp_path, config, jinja="{{ bos_token }}" + CHATML)
    counter = TokenizerCounter.for_model(folder)
    assert counter.template.cost == ChatTemplateCost(per_message=3, fixed=11, fixed_after_system=3)


def test_named_templates_use_the_default_one(tmp_path: Path) -> None:
    named = [{"name": "tool_use", "template": "{{ 'a b c d e f g' }}"}, {"name": "default", "template": CHATML}]  # fmt: skip
    counter = TokenizerCounter.for_model(model_folder(tmp_path, {"chat_template": named}))
    assert counter.template.cost.fixed == 10


@pytest.mark.parametrize(
    "template",
    [
        None,  # no template at all
        "{{ raise_exception('Conversation roles must alternate') }}",  # refuses the probes
        "{% generation %}{{ messages }}{% endgeneration %}",  # a tag transformers adds
    ],
)
def test_a_template_it_cannot_render_leaves_the_generic_price(
    tmp_path: Path, template: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    config = {} if template is None else {"chat_template": template}
    with caplog.at_level(logging.WARNING, "tandem.admission"):
        counter = TokenizerCounter.for_model(model_folder(tmp_path, config))
    assert counter.template.cost == GENERIC
    assert bool(caplog.records) == (template is not None)


def test_measure_reads_no_folder_without_a_template(tmp_path: Path) -> None:
    assert measure(tmp_path, lambda text: len(text.split())).cost == GENERIC


def test_the_price_depends_on_the_first_role() -> None:
    cost = ChatTemplateCost(per_message=5, fixed=20, fixed_after_system=3)
    assert (cost.of(2, led_by_system=False), cost.of(2, led_by_system=True)) == (30, 13)
