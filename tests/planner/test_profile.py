"""The worker profile: interpolation, capacity at a latency target, its file and its errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from planner.profile import DecodePoint, PrefillPoint, Profile, ProfileError

PROFILE = Profile(
    "smol@1",
    prefill=(PrefillPoint(128, 4000.0), PrefillPoint(1024, 2000.0)),
    decode=(DecodePoint(1, 0.02), DecodePoint(8, 0.04), DecodePoint(32, 0.12)),
)


def test_prefill_throughput_is_interpolated_and_clamped() -> None:
    assert PROFILE.prefill_tokens_per_s(128) == 4000.0
    assert PROFILE.prefill_tokens_per_s(576) == pytest.approx(3000.0)
    assert PROFILE.prefill_tokens_per_s(10) == 4000.0  # no extrapolation either way
    assert PROFILE.prefill_tokens_per_s(100_000) == 2000.0


def test_decode_capacity_is_where_the_latency_crosses_the_target() -> None:
    assert PROFILE.decode_concurrency(0.04) == 8.0
    assert PROFILE.decode_concurrency(0.08) == pytest.approx(20.0)  # halfway from 8 to 32
    assert PROFILE.decode_concurrency(0.01) == 1.0  # even one stream misses: one still runs
    assert PROFILE.decode_concurrency(1.0) == 32.0  # met at every measured load
    assert PROFILE.expected_itl_s(20) == pytest.approx(0.08)


def test_a_profile_round_trips_through_its_file(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    PROFILE.save(path)
    assert Profile.load(path) == PROFILE


def test_a_missing_profile_says_how_to_make_one(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="tandem profile"):
        Profile.load(tmp_path / "none.json")


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"format": 0}, "format"),
        ({"prefill": []}, "prefill"),
        ({"prefill": [{"prompt_tokens": 512, "tokens_per_s": 1.0},
                      {"prompt_tokens": 128, "tokens_per_s": 1.0}]}, "prefill.prompt_tokens"),
        ({"prefill": [{"prompt_tokens": 128, "tokens_per_s": 0}]}, "prefill.tokens_per_s"),
        ({"decode": [{"concurrency": 1, "itl_s": -1}]}, "decode.itl_s"),
        ({"decode": [{"concurrency": 1}]}, "profile"),
    ],
)  # fmt: skip
def test_a_bad_profile_names_its_field(change: dict[str, object], param: str) -> None:
    raw = {**PROFILE.to_dict(), **change}
    with pytest.raises(ProfileError) as caught:
        Profile.from_dict(raw)
    assert caught.value.param == param
