"""Hypothesis profiles of the property tests, chosen by ``TANDEM_HYPOTHESIS_PROFILE``.

- ``ci`` (the default): each test draws the number of examples it asks for with ``examples(n)``,
  sized so the whole directory fits its share of CI's time, and always the same ones
  (``derandomize``): a failure in CI is a regression, and it reproduces on any machine.
- ``thorough``: fresh random examples, ``THOROUGH_FACTOR`` times as many, for a run by hand
  (``TANDEM_HYPOTHESIS_PROFILE=thorough .venv/bin/python -m pytest tests/properties``).

Neither keeps an example database (nothing written to the working tree); a failure prints the
``@reproduce_failure`` blob that replays it.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

PROFILE_ENV = "TANDEM_HYPOTHESIS_PROFILE"
THOROUGH_FACTOR = 25

for _name, _derandomize in (("ci", True), ("thorough", False)):
    settings.register_profile(
        _name,
        derandomize=_derandomize,
        deadline=None,  # examples run real asyncio and a real Redis: their time varies
        database=None,
        print_blob=True,
        # Long operation lists are drawn on purpose.
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


def profile_name() -> str:
    """The profile asked for (``ci`` unless the environment says otherwise)."""
    name = os.environ.get(PROFILE_ENV, "ci")
    if name not in ("ci", "thorough"):
        raise ValueError(f"{PROFILE_ENV}={name!r}: use 'ci' (the default) or 'thorough'")
    return name


def examples(ci: int) -> int:
    """How many examples a test draws: ``ci`` in CI, ``THOROUGH_FACTOR`` times more when
    thorough."""
    return ci * THOROUGH_FACTOR if profile_name() == "thorough" else ci
