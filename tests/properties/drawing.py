"""What the ledger and idempotency properties share in drawing and running their histories."""

from __future__ import annotations

from typing import TypeVar

from hypothesis import Phase
from hypothesis import strategies as st

T = TypeVar("T")

NO_EXPLAIN = tuple(phase for phase in Phase if phase is not Phase.explain)
"""Every phase but explain, which replays a failing history hundreds of times (minutes against
a database) to annotate a printout that schemathesis's pytest plugin blanks anyway: it swaps
hypothesis's printer for a silent one. Each history is ``note()``d instead."""


def weighted(*choices: tuple[int, st.SearchStrategy[T]]) -> st.SearchStrategy[T]:
    """Each strategy drawn in proportion to its weight (``st.one_of`` merges repeated ones)."""
    pool = [strategy for weight, strategy in choices for _ in range(weight)]
    return st.sampled_from(pool).flatmap(lambda strategy: strategy)
