"""Property tests (hypothesis): the profile is loaded before any test module is imported, so
every ``@settings`` inherits it (see ``tests/properties/profiles.py``)."""

from __future__ import annotations

from hypothesis import settings

from tests.properties.profiles import profile_name

settings.load_profile(profile_name())
