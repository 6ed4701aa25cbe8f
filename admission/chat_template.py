"""What a model's chat template adds to a conversation's tokens, measured once per model.

The engine renders a chat request through the model's chat template before it counts the
prompt: each message gets its role's markers, the reply is primed, and many templates add a
default system message to a conversation that has none (the bundled SmolLM2's adds 21 tokens).
Admission counts the message texts (``admission.tokens``); this module prices the rest, so a
reservation holds what the engine will count (a one-message chat on the bundled model was 23
tokens short of it when priced 4 a message and 3 of priming). A reservation short of the
usage leaves a debt that only the reconcile pays, and a reconcile lost to a quota-store outage
then lets the tenant past its TPM.

The template is rendered as transformers (and so vLLM) renders it: a sandboxed Jinja
environment with ``trim_blocks`` and ``lstrip_blocks``, ``raise_exception``, ``strftime_now``,
and the tokenizer's special tokens as variables. It is rendered for a few conversations of
empty messages and each rendering counted:

- ``per_message``: half the tokens that two more messages (assistant, user) add;
- ``fixed``: one user message's conversation less one message (the priming, and the default
  system message of a template that adds one);
- ``fixed_after_system``: the same for a conversation led by a system message.

Texts are counted apart from their markers. A token that would span a marker and a text is
then counted in both, and half tokens a message round up: the price errs towards reserving a
little more, never less, on the templates measured (``tests/admission/test_chat_template.py``,
and the real engine's count in ``tests/e2e/test_admission.py``).

A request's tool definitions are priced by rendering the template with them around one
empty message, less that message's rendering: exact, whether the template writes each tool's
JSON, reformats it, or leaves tools out (the bundled SmolLM2's does: they add nothing). The
tokenizer counter keeps the answer like a text's count, since an application sends the same
tools every time.

Tool calls in earlier assistant messages are priced the same way: the template rendered with
one assistant message holding them, less that message empty. Their ``arguments`` strings are
parsed to objects first, as vLLM does before it renders (a template writes them as it likes).
The counter keeps each message's price, since a conversation sends its history again at
every turn.

A template that cannot be read or rendered for these conversations (one that needs tools, or
Jinja tags transformers adds) leaves the generic price, the 3-4 tokens a message and 3 of
priming OpenAI's cookbook counts, tools priced as their JSON, and a warning.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

log = logging.getLogger("tandem.admission")


@dataclass(frozen=True, slots=True)
class ChatTemplateCost:
    """Tokens a chat template adds around a conversation's texts."""

    per_message: int
    fixed: int
    """Added once to a conversation not led by a system message (the reply's priming and any
    default system message)."""
    fixed_after_system: int
    """Added once to a conversation led by a system message."""

    def of(self, num_messages: int, led_by_system: bool) -> int:
        """The tokens the template adds to a conversation of ``num_messages`` messages."""
        return self.per_message * num_messages + (
            self.fixed_after_system if led_by_system else self.fixed
        )


GENERIC = ChatTemplateCost(per_message=4, fixed=3, fixed_after_system=3)
"""Without a template to measure."""

Count = Callable[[str], int]
_Render = Callable[..., str]


class ChatTemplate:
    """A model's chat template as admission prices it: ``cost`` around the messages, and
    ``tools_tokens`` and ``tool_calls_tokens`` for a request's tool definitions and its
    history's tool calls."""

    def __init__(
        self,
        cost: ChatTemplateCost,
        count: Count,
        render: _Render | None = None,
        baselines: tuple[int, int] = (0, 0),
    ) -> None:
        """``render`` renders the template; ``baselines``: the tokens of its renderings of one
        empty user message, and of that message and an empty assistant reply. None prices
        tools and tool calls as their JSON."""
        self.cost = cost
        self._count = count
        self._render = render
        self._one, self._replied = baselines

    @classmethod
    def generic(cls, count: Count) -> ChatTemplate:
        """No template to render: ``GENERIC``, and tools priced as their JSON."""
        return cls(GENERIC, count)

    def tools_tokens(self, tools: list[Any]) -> int:
        """What a request's ``tools`` add to its prompt: the template rendered with them (a
        template that leaves them out adds nothing); their JSON when it cannot be rendered
        with them, or there is no template. Can take a while for many tools: called off the
        loop for long ones (``admission.tokens``)."""
        return self._added(
            "tools", tools, lambda render: render([_message("user")], tools), self._one
        )

    def tool_calls_tokens(self, calls: list[Any]) -> int:
        """What one assistant message's ``tool_calls`` add to the prompt: the template
        rendered with them, less the message without them; their JSON when it cannot be
        rendered with them, or there is no template. Off the loop for long ones, as tools."""

        def with_calls(render: _Render) -> str:
            reply = {"role": "assistant", "content": "", "tool_calls": _as_rendered(calls)}
            return render([_message("user"), reply])

        return self._added("tool calls", calls, with_calls, self._replied)

    def _added(
        self, what: str, value: list[Any], rendering: Callable[[_Render], str], baseline: int
    ) -> int:
        """The tokens of ``rendering`` less ``baseline``'s; ``value``'s JSON when the template
        rejects it (a template rejects a shape many ways), or there is none."""
        if self._render is not None:
            try:
                return max(0, self._count(rendering(self._render)) - baseline)
            except Exception as exc:  # noqa: BLE001 - see the docstring
                log.info("chat template cannot render these %s (%s): priced as JSON", what, exc)
        return self._count(json.dumps(value, ensure_ascii=False))


def measure(model_dir: Path, count: Count) -> ChatTemplate:
    """``model_dir``'s chat template, its renderings counted with ``count`` (the model's
    tokenizer, special tokens as one token each); ``ChatTemplate.generic`` when there is none
    or it cannot be rendered."""
    try:
        found = _read_template(model_dir)
        if found is None:
            return ChatTemplate.generic(count)
        template, variables = found
        render = _compile(template, variables)
        one = count(render([_message("user")]))
        replied = count(render([_message("user"), _message("assistant")]))
        three = count(render([_message("user"), _message("assistant"), _message("user")]))
        led = count(render([_message("system"), _message("user")]))
    except Exception as exc:  # noqa: BLE001 - Jinja and JSON raise many kinds; all mean "unreadable"
        log.warning(
            "cannot measure the chat template of %s (%s); pricing %d tokens a message",
            model_dir, exc, GENERIC.per_message,
        )  # fmt: skip
        return ChatTemplate.generic(count)
    per_message = max(0, math.ceil((three - one) / 2))
    cost = ChatTemplateCost(
        per_message=per_message,
        fixed=max(0, one - per_message),
        fixed_after_system=max(0, led - 2 * per_message),
    )
    return ChatTemplate(cost, count, render, (one, replied))


def _message(role: str) -> dict[str, Any]:
    return {"role": role, "content": ""}


def _as_rendered(calls: list[Any]) -> list[Any]:
    """``calls`` as vLLM hands them to a template: each function's ``arguments`` a JSON
    object, parsed from its string (an empty object for a missing, malformed or non-object
    one). Raises on a call of another shape (the JSON price then applies)."""
    rendered = []
    for call in calls:
        function = dict(call["function"])
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments else {}
            except json.JSONDecodeError:
                arguments = {}
        function["arguments"] = arguments if isinstance(arguments, dict) else {}
        rendered.append({**call, "function": function})
    return rendered


def _read_template(model_dir: Path) -> tuple[str, dict[str, str]] | None:
    """The template (``chat_template.jinja`` first, as transformers reads it, else
    ``tokenizer_config.json``'s default one) and the special tokens it may refer to."""
    config_file = model_dir / "tokenizer_config.json"
    config: dict[str, Any] = json.loads(config_file.read_text()) if config_file.is_file() else {}
    variables = {
        name: value["content"] if isinstance(value, dict) else value
        for name, value in config.items()
        if name.endswith("_token") and isinstance(value, str | dict)
    }
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(), variables
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one is the chat's
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return (template, variables) if isinstance(template, str) else None


def _compile(template: str, variables: dict[str, str]) -> _Render:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    compiled = env.from_string(template)

    def render(messages: list[dict[str, Any]], tools: list[Any] | None = None) -> str:
        return compiled.render(
            messages=messages, tools=tools, add_generation_prompt=True, **variables
        )

    return render


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers' own filter, arguments and all: a template may pass any of them.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise(message: str) -> None:
    raise jinja2.TemplateError(message)
