"""Moderation: checks request input before admission and streamed output through a
hold-back window, by per-tenant policy, with rule, PII and remote (OpenAI-compatible)
providers; also answers ``/v1/moderations``. Imports only ``core`` and aiohttp: the gateway
wires it in.

The flow, and where each step lives:

1. Startup: :func:`load_rules` builds a :class:`RuleSet` (shipped default or an operator's
   file) for a :class:`RulesProvider`; :class:`RemoteProvider` s get a
   :class:`RemoteProviderConfig` each; :class:`Moderator` owns them all
   (``start``/``aclose``) and checks the stream window against the rules.
2. Input (``moderator``): the request's texts are ``core.prompt.Prompt.texts``;
   :meth:`Moderator.check_input` runs the policy's providers concurrently and returns an
   :class:`InputVerdict` (blocked -> 400 ``content_filter``; redacted texts go back into the
   body with :func:`with_texts`).
3. Output (``stream``): :meth:`Moderator.output_stream` gives one :class:`StreamModerator` per
   choice; ``feed`` each delta, send the :class:`Release` d text, ``finish`` at the end; a
   block ends the choice with ``finish_reason: "content_filter"``.
4. Every action, flags included, is a :class:`~core.moderation.ModerationDecision`.
5. ``/v1/moderations`` (``openai_shape``): :func:`parse_moderation_input`,
   :meth:`Moderator.classify`, :func:`moderation_response`.
"""

from moderation.hits import Hit, TextResult
from moderation.inputs import with_texts
from moderation.moderator import InputVerdict, Moderator
from moderation.openai_shape import moderation_response, parse_moderation_input
from moderation.pii import DETECTORS, PiiMatch, find_pii
from moderation.provider import ManagedProvider, ModerationProvider
from moderation.remote import RemoteProvider, RemoteProviderConfig
from moderation.rules import RuleSet, RulesProvider, load_rules
from moderation.stream import Release, StreamConfig, StreamModerator

__all__ = [
    "DETECTORS",
    "Hit",
    "InputVerdict",
    "ManagedProvider",
    "ModerationProvider",
    "Moderator",
    "PiiMatch",
    "Release",
    "RemoteProvider",
    "RemoteProviderConfig",
    "RuleSet",
    "RulesProvider",
    "StreamConfig",
    "StreamModerator",
    "TextResult",
    "find_pii",
    "load_rules",
    "moderation_response",
    "parse_moderation_input",
    "with_texts",
]
