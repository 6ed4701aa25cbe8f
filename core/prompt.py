"""A request's prompt, read once from its validated chat or completions body.

Admission counts :attr:`Prompt.texts` with the model's tokenizer, input moderation checks
them, the request log stores :attr:`Prompt.raw`, and prefill affinity keys on the start of
the prompt: one reading, so the gateway's steps cannot disagree on what the prompt is.

:func:`walk_texts` is the one walker over a body's texts: :meth:`Prompt.parse` reads through
it and ``moderation.inputs.with_texts`` writes redacted texts back through it, so the n-th text
of :attr:`Prompt.texts` is the n-th text replaced. Shapes it does not know (image parts, a
message without content, a malformed entry) carry no text and are left alone: validating the
body is the gateway's job.

:class:`TokenEstimate` is what admission makes of a prompt (and the output it may ask for).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from core.messages import Endpoint

Visit = Callable[[str, int], str]
"""Gets a text and the index of the chat message or completions ``prompt`` entry holding it
(0 for a string prompt); returns the text to put in its place (the same object: no change)."""


@dataclass(frozen=True, slots=True)
class Prompt:
    """The prompt of one chat or completions request."""

    endpoint: Endpoint
    param: str
    """The body field holding the prompt (``messages`` or ``prompt``): errors name it."""
    raw: Any
    """That field's value as the client sent it (not a copy: never change it)."""
    texts: tuple[str, ...]
    """Every text in order: each chat message's content (a string, or its ``type: "text"``
    parts), or a completions prompt (a string, or each string of a list)."""
    num_literal_tokens: int
    """Tokens given as ids: a completions prompt of token ids, or of lists of them."""
    num_messages: int
    """Chat messages (0 for completions)."""
    led_by_system: bool = False
    """The first chat message is a ``system`` one: a chat template that adds a default
    system message to other conversations adds none (``admission.chat_template``)."""
    _owners: tuple[int, ...] = field(default=(), repr=False)
    """Per text, the index in :attr:`raw` of the message or entry holding it."""

    @staticmethod
    def parse(endpoint: Endpoint, body: dict[str, Any]) -> Prompt:
        """Read the prompt of a validated ``endpoint`` request body, in one pass over it."""
        texts: list[str] = []
        owners: list[int] = []
        num_literal_tokens = 0

        def visit(text: str, at: int) -> str:
            texts.append(text)
            owners.append(at)
            return text

        def count_ids(count: int) -> None:
            nonlocal num_literal_tokens
            num_literal_tokens += count

        walk_texts(endpoint, body, visit, count_ids)
        chat = endpoint is Endpoint.CHAT
        param = "messages" if chat else "prompt"
        raw = body.get(param)
        return Prompt(
            endpoint=endpoint,
            param=param,
            raw=raw,
            texts=tuple(texts),
            num_literal_tokens=num_literal_tokens,
            num_messages=len(raw) if chat and isinstance(raw, list) else 0,
            led_by_system=chat and _first_role(raw) == "system",
            _owners=tuple(owners),
        )

    def without_texts(self) -> Prompt:
        """This prompt with ``raw`` and ``texts`` let go and its counts kept: what a request
        holds once nothing reads its texts again (``Request.let_go_of_prompt``)."""
        return Prompt(
            endpoint=self.endpoint,
            param=self.param,
            raw=None,
            texts=(),
            num_literal_tokens=self.num_literal_tokens,
            num_messages=self.num_messages,
            led_by_system=self.led_by_system,
        )

    def messages(self) -> Iterator[tuple[str, str]]:
        """Each chat message's role and its texts joined, in order, computed as iterated
        (nothing for completions). A message without text has an empty one."""
        if self.endpoint is not Endpoint.CHAT or not isinstance(self.raw, list):
            return
        cursor = 0
        for index, message in enumerate(self.raw):
            start = cursor
            while cursor < len(self._owners) and self._owners[cursor] == index:
                cursor += 1
            role = message.get("role") if isinstance(message, dict) else None
            yield str(role), "".join(self.texts[start:cursor])


def _first_role(messages: Any) -> object:
    if isinstance(messages, list) and messages and isinstance(messages[0], dict):
        return messages[0].get("role")
    return None


def walk_texts(
    endpoint: Endpoint,
    body: dict[str, Any],
    visit: Visit,
    count_ids: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Call ``visit`` on each text of ``body`` in order, and ``count_ids`` with the length of
    each run of token ids (completions only); return ``body`` with each text replaced by what
    ``visit`` returned.

    Copy on write: ``body`` itself comes back when every text came back unchanged, else a copy
    of only the containers on the way to a changed text; ``body`` is never modified.
    """
    if endpoint is Endpoint.CHAT:
        param = "messages"
        old = body.get(param)
        new = _walk_messages(old, visit) if isinstance(old, list) else old
    else:
        param = "prompt"
        old = body.get(param)
        new = _walk_prompt(old, visit, count_ids)
    return body if new is old else {**body, param: new}


def _walk_messages(messages: list[Any], visit: Visit) -> list[Any]:
    out: list[Any] | None = None
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        new: object
        if isinstance(content, str):
            new = visit(content, index)
        elif isinstance(content, list):
            new = _walk_parts(content, index, visit)
        else:
            continue
        if new is not content:
            if out is None:
                out = list(messages)
            out[index] = {**message, "content": new}
    return messages if out is None else out


def _walk_parts(parts: list[Any], index: int, visit: Visit) -> list[Any]:
    # Only text parts: an image or audio part's fields are not prompt text.
    out: list[Any] | None = None
    for position, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("type") != "text":
            continue
        text = part.get("text")
        if not isinstance(text, str):
            continue
        new = visit(text, index)
        if new is not text:
            if out is None:
                out = list(parts)
            out[position] = {**part, "text": new}
    return parts if out is None else out


def _walk_prompt(prompt: Any, visit: Visit, count_ids: Callable[[int], None] | None) -> Any:
    if isinstance(prompt, str):
        return visit(prompt, 0)
    if not isinstance(prompt, list) or not prompt:
        return prompt
    if isinstance(prompt[0], int):
        # The schema's shapes are str, list[str], list[int] and list[list[int]]: a list that
        # starts with an id is all ids, counted without walking it (it may be long).
        if count_ids is not None:
            count_ids(len(prompt))
        return prompt
    out: list[Any] | None = None
    for index, entry in enumerate(prompt):
        if isinstance(entry, str):
            new = visit(entry, index)
            if new is not entry:
                if out is None:
                    out = list(prompt)
                out[index] = new
        elif isinstance(entry, list) and count_ids is not None:
            count_ids(len(entry))
    return prompt if out is None else out


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
