"""Looking for credentials where they must never be: logs, metrics, traces, error bodies, stores.

A ``Secret`` is searched for whole and, for a tenant key, also by its secret part alone (what
follows the display prefix that listings show), so a key logged without its ``tdm-`` prefix or
cut after the prefix is still caught. Used by the fast tier (``tests/security``) and by the
end-to-end run's log check (``tests/e2e/test_zy_secrets.py``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from admission.tenants import KEY_PREFIX, display_prefix


@dataclass(frozen=True, slots=True)
class Secret:
    """A credential and what to call it in a failure message (never the value itself)."""

    name: str
    value: str

    @property
    def needles(self) -> tuple[str, ...]:
        """The strings whose presence is a leak."""
        if self.value.startswith(KEY_PREFIX):
            return (self.value, self.value[len(display_prefix(self.value)) :])
        return (self.value,)


def tenant_keys(keys: Iterable[str]) -> list[Secret]:
    """Tenant keys as secrets, named by their (public) display prefix."""
    return [Secret(f"tenant key {display_prefix(key)}...", key) for key in keys]


def leaks_in(where: str, content: str | bytes, secrets: Iterable[Secret]) -> list[str]:
    """``"<secret> in <where>"`` for each secret found in ``content``."""
    found = []
    for secret in secrets:
        for needle in secret.needles:
            hit = needle.encode() in content if isinstance(content, bytes) else needle in content
            if hit:
                found.append(f"{secret.name} in {where}")
                break
    return found
