"""What one output-moderation check costs with the shipped rules: microseconds per check.

    python -m bench.moderation_check [--repeat 7] [--answers 200]

A streamed answer is checked at every chunk (``moderation/stream.py``): each check sees the
last ``overlap_chars`` of released text plus the held-back window and the new chunk. This
script streams typical assistant answers (English prose in word-sized chunks, the default
48-character window and overlap) through the shipped rules and prints the median over
``--repeat`` runs of:

- ``check_text``: ``RulesProvider.check_text`` alone, on the texts the stream checks;
- ``per chunk``: a whole ``StreamModerator.feed`` through ``Moderator.output_stream`` (the
  policy the overhead benchmark's moderated target uses: PII redacted, the rest flagged).

Each on three kinds of text: ASCII prose, prose with typographic punctuation (curly quotes,
dashes: not ASCII), and prose with a few digits (a year, a count). Figures, never assertions:
the host may be noisy, so compare medians of runs on the same machine.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import time
from collections.abc import Callable
from functools import partial
from types import MappingProxyType

from core.moderation import Action, StagePolicy
from moderation.hits import Hit
from moderation.moderator import Moderator
from moderation.rules import RulesProvider, load_rules
from moderation.stream import StreamConfig, StreamModerator

PROSE = (
    "Sure! Here is a short overview of how the water cycle works. Water evaporates from "
    "oceans, lakes and rivers when the sun warms the surface, and the vapour rises into the "
    "atmosphere. As it climbs, it cools and condenses into tiny droplets that form clouds. "
    "When those droplets grow heavy enough, they fall back to the ground as rain, snow or "
    "hail. Some of that water soaks into the soil and feeds plants or refills underground "
    "aquifers, while the rest runs off into streams that carry it back to the sea. The cycle "
    "then starts again. If you would like, I can also explain how climate change affects "
    "each of these steps, or suggest a simple experiment you could do at home to see "
    "condensation happen on a cold glass."
)
TYPOGRAPHIC = (
    PROSE.replace("Sure!", "Sure \u2014 here\u2019s the idea.")
    .replace("rain, snow or hail", "\u201crain\u201d, \u201csnow\u201d or \u201chail\u201d")
    .replace("then starts again", "then starts again \u2014 endlessly")
)
DIGITS = PROSE.replace("Sure!", "Sure! In 2024 about 505,000 km3 evaporated.").replace(
    "The cycle", "In 9 to 10 days the cycle"
)
TEXTS = {"ascii prose": PROSE, "typographic": TYPOGRAPHIC, "with digits": DIGITS}
POLICY = StagePolicy(("rules",), MappingProxyType({"pii": Action.REDACT, "*": Action.FLAG}))
_TOKEN = re.compile(r"\s*\S{1,6}")


def chunks_of(text: str) -> list[str]:
    """Word-sized pieces, as an engine streams them (a leading space, at most 6 letters)."""
    return _TOKEN.findall(text)


def checked_texts(provider: RulesProvider, text: str, config: StreamConfig) -> list[str]:
    """The texts a stream of ``text`` checks, in order."""
    seen: list[str] = []

    async def check(window: str) -> list[Hit]:
        seen.append(window)
        return list(provider.check_text(window).hits)

    async def stream() -> None:
        mod = StreamModerator(check, POLICY, config)
        for chunk in chunks_of(text):
            await mod.feed(chunk)
        await mod.finish()

    asyncio.run(stream())
    return seen


def time_checks(provider: RulesProvider, windows: list[str], answers: int) -> float:
    """Microseconds per ``check_text``."""
    check = provider.check_text
    start = time.perf_counter()
    for _ in range(answers):
        for window in windows:
            check(window)
    return (time.perf_counter() - start) / (answers * len(windows)) * 1e6


def time_stream(moderator: Moderator, text: str, answers: int) -> float:
    """Microseconds per ``feed`` (the final ``finish`` included, counted as one more)."""
    pieces = chunks_of(text)

    async def run() -> float:
        start = time.perf_counter()
        for _ in range(answers):
            mod = moderator.output_stream(POLICY)
            for piece in pieces:
                await mod.feed(piece)
            await mod.finish()
        return (time.perf_counter() - start) / (answers * (len(pieces) + 1)) * 1e6

    return asyncio.run(run())


def median_of(repeat: int, measure: Callable[[], float]) -> tuple[float, float, float]:
    runs = sorted(measure() for _ in range(repeat))
    return statistics.median(runs), runs[0], runs[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=7, help="runs per figure (median shown)")
    parser.add_argument("--answers", type=int, default=200, help="answers streamed per run")
    parser.add_argument(
        "--batch-chars",
        type=int,
        default=0,
        help="StreamConfig.batch_chars (TANDEM_MODERATION_BATCH_CHARS): check once this many "
        "characters can go out; 0 checks at every chunk",
    )
    args = parser.parse_args()
    config = StreamConfig(batch_chars=args.batch_chars)
    provider = RulesProvider(load_rules(None))
    moderator = Moderator({"rules": provider}, config)
    print(f"{'text':<12} {'checks':>6} {'check_text us':>22} {'per chunk us':>22}")
    for label, text in TEXTS.items():
        windows = checked_texts(provider, text, config)
        check = median_of(args.repeat, partial(time_checks, provider, windows, args.answers))
        chunk = median_of(args.repeat, partial(time_stream, moderator, text, args.answers))
        print(
            f"{label:<12} {len(windows):>6} "
            f"{check[0]:>8.2f} ({check[1]:.2f}-{check[2]:.2f}) "
            f"{chunk[0]:>8.2f} ({chunk[1]:.2f}-{chunk[2]:.2f})"
        )


if __name__ == "__main__":
    main()
