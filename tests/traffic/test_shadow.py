"""ShadowLimiter: the in-flight cap per version, sent and dropped counts, releases."""

from __future__ import annotations

import pytest

from traffic.shadow import ShadowLimiter


def test_caps_in_flight_and_counts_drops() -> None:
    limiter = ShadowLimiter()
    assert [limiter.try_acquire("a@3", 2) for _ in range(5)] == [True, True, False, False, False]
    assert (limiter.in_flight("a@3"), limiter.sent("a@3"), limiter.dropped("a@3")) == (2, 2, 3)

    limiter.release("a@3")
    assert limiter.in_flight("a@3") == 1
    assert limiter.try_acquire("a@3", 2)
    assert not limiter.try_acquire("a@3", 2)
    assert (limiter.in_flight("a@3"), limiter.sent("a@3"), limiter.dropped("a@3")) == (2, 3, 4)


def test_versions_are_capped_apart() -> None:
    limiter = ShadowLimiter()
    assert limiter.try_acquire("a@3", 1)
    assert not limiter.try_acquire("a@3", 1)
    assert limiter.try_acquire("b@3", 1)
    assert (limiter.dropped("a@3"), limiter.dropped("b@3")) == (1, 0)
    assert (limiter.in_flight("c@3"), limiter.sent("c@3"), limiter.dropped("c@3")) == (0, 0, 0)


def test_a_lowered_cap_applies_to_the_next_copy() -> None:
    limiter = ShadowLimiter()
    for _ in range(4):
        assert limiter.try_acquire("a@3", 4)
    assert not limiter.try_acquire("a@3", 2)  # the policy now says 2: no more until below it
    for _ in range(3):
        limiter.release("a@3")
    assert limiter.try_acquire("a@3", 2)


def test_releasing_what_is_not_held_is_refused() -> None:
    limiter = ShadowLimiter()
    assert limiter.try_acquire("a@3", 1)
    limiter.release("a@3")
    with pytest.raises(ValueError, match="no shadow copy"):
        limiter.release("a@3")
    assert limiter.in_flight("a@3") == 0
    assert limiter.try_acquire("a@3", 1)
