"""The admin credential of the embedded default: generated once, kept in a private file."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

ADMIN_KEY_FILE = "admin.key"


def load_or_create_admin_key(state_dir: Path) -> tuple[str, Path]:
    """The admin key in ``state_dir/admin.key``, created (mode 0600) if missing."""
    path = state_dir / ADMIN_KEY_FILE
    if path.is_file():
        key = path.read_text().strip()
        if key:
            return key, path
    state_dir.mkdir(parents=True, exist_ok=True)
    key = "tdm-admin-" + secrets.token_urlsafe(32)
    # O_EXCL: two gateways starting at once on one state dir cannot write different keys.
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_text().strip(), path
    with os.fdopen(fd, "w") as handle:
        handle.write(key + "\n")
    return key, path
