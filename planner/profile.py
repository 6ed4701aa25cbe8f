"""A worker's measured capacity, the planner's model of one replica (as Dynamo's planner
interpolates its profile; the planner refuses to run without one).

- Prefill: tokens per second one worker computes, by prompt length (longer prompts cost more
  per token: attention is quadratic), interpolated linearly between measured lengths.
- Decode: at each measured concurrency, the inter-token latency and the tokens per second one
  worker sustains; the capacity at a latency target is the largest concurrency whose ITL meets
  it (interpolated between the two measured points around the target).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

FORMAT = 1
"""The profile file's format; a file of another format is refused, never guessed at."""


class ProfileError(ValueError):
    """A profile the planner cannot use; ``param`` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class PrefillPoint:
    prompt_tokens: int
    tokens_per_s: float
    """Prompt tokens one worker prefills per second at this prompt length."""


@dataclass(frozen=True, slots=True)
class DecodePoint:
    concurrency: int
    """Streams decoding at once on one worker."""
    itl_s: float
    """Their mean inter-token latency."""


@dataclass(frozen=True, slots=True)
class Profile:
    """One version's worker, measured: prefill by prompt length, decode by concurrency."""

    version: str
    prefill: tuple[PrefillPoint, ...]
    decode: tuple[DecodePoint, ...]

    def __post_init__(self) -> None:
        _check_increasing([p.prompt_tokens for p in self.prefill], "prefill", "prompt_tokens")
        _check_increasing([p.concurrency for p in self.decode], "decode", "concurrency")
        if any(p.tokens_per_s <= 0 for p in self.prefill):
            raise ProfileError("prefill throughput must be positive", "prefill.tokens_per_s")
        if any(p.itl_s <= 0 for p in self.decode):
            raise ProfileError("inter-token latencies must be positive", "decode.itl_s")

    def prefill_tokens_per_s(self, prompt_tokens: float) -> float:
        """One worker's prefill throughput at ``prompt_tokens`` (clamped to the measured
        range: no extrapolation past what was measured)."""
        xs = [float(p.prompt_tokens) for p in self.prefill]
        ys = [p.tokens_per_s for p in self.prefill]
        return _interpolate(xs, ys, prompt_tokens)

    def decode_concurrency(self, itl_target_s: float) -> float:
        """How many streams one worker decodes at once within ``itl_target_s`` per token: the
        measured concurrency where the ITL crosses the target, interpolated; the smallest
        measured one when even that misses the target (at least one stream always runs)."""
        points = self.decode
        if itl_target_s <= points[0].itl_s:
            return float(points[0].concurrency)
        for low, high in itertools.pairwise(points):
            if low.itl_s <= itl_target_s <= high.itl_s:
                if high.itl_s == low.itl_s:
                    return float(high.concurrency)
                share = (itl_target_s - low.itl_s) / (high.itl_s - low.itl_s)
                return low.concurrency + share * (high.concurrency - low.concurrency)
        return float(points[-1].concurrency)  # the target is met at every measured load

    def expected_itl_s(self, concurrency: float) -> float:
        """The ITL the profile expects at ``concurrency`` streams per worker."""
        xs = [float(p.concurrency) for p in self.decode]
        return _interpolate(xs, [p.itl_s for p in self.decode], concurrency)

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, **asdict(self)}

    @classmethod
    def from_dict(cls, raw: Any) -> Profile:
        if not isinstance(raw, dict):
            raise ProfileError("a profile is a JSON object", "profile")
        if raw.get("format") != FORMAT:
            raise ProfileError(
                f"profile format {raw.get('format')!r} is not {FORMAT}: measure it again with "
                "this version of Tandem",
                "format",
            )
        try:
            return cls(
                version=str(raw["version"]),
                prefill=tuple(
                    PrefillPoint(int(p["prompt_tokens"]), float(p["tokens_per_s"]))
                    for p in raw["prefill"]
                ),
                decode=tuple(
                    DecodePoint(int(p["concurrency"]), float(p["itl_s"])) for p in raw["decode"]
                ),
            )
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, ProfileError):
                raise
            raise ProfileError(f"malformed profile: {exc!r}", "profile") from exc

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> Profile:
        """The profile at ``path``; ``ProfileError`` saying how to make one when missing."""
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError as exc:
            raise ProfileError(
                f"no worker profile at {path}: measure one first (tandem profile)", "profile"
            ) from exc
        except json.JSONDecodeError as exc:
            raise ProfileError(f"{path} is not JSON: {exc}", "profile") from exc
        return cls.from_dict(raw)


def _check_increasing(values: Sequence[int], section: str, field: str) -> None:
    if not values:
        raise ProfileError(f"the profile has no {section} measurements", section)
    if any(v <= 0 for v in values) or any(b <= a for a, b in itertools.pairwise(values)):
        raise ProfileError(
            f"{section} points must have positive, strictly increasing {field}",
            f"{section}.{field}",
        )


def _interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear ``y(x)`` through the points, constant beyond the ends."""
    if x <= xs[0]:
        return ys[0]
    for (x0, y0), (x1, y1) in itertools.pairwise(zip(xs, ys, strict=True)):
        if x <= x1:
            return y0 + (x - x0) / (x1 - x0) * (y1 - y0)
    return ys[-1]
