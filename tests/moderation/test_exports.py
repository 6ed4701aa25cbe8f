"""The package's public surface is pinned: the gateway imports these names."""

from __future__ import annotations

from pathlib import Path

import moderation


def test_public_exports() -> None:
    assert sorted(moderation.__all__) == [
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
    for name in moderation.__all__:
        assert getattr(moderation, name) is not None


def test_only_core_and_third_party_are_imported() -> None:
    """Siblings never import each other (import-linter enforces it too; this fails faster)."""
    for source in Path(moderation.__file__).parent.glob("*.py"):
        text = source.read_text()
        for sibling in ("gateway", "admission", "billing", "prefill_pool", "decode_pool"):
            assert f"from {sibling}" not in text, source
            assert f"import {sibling}" not in text, source
