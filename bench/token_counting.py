"""What counting a prompt's tokens costs the gateway, with the served model's tokenizer.

    python -m bench.token_counting [--repeat 5] [--model-dir DIR]

Admission counts every request's prompt before it reserves quota (``admission/tokens.py``).
The text is prose from this repository's ``docs/ARCHITECTURE.md`` (varied words, as real
prompts are; a prompt of a few repeated words tokenizes faster). The tokenizer is the bundled
SmolLM2's unless ``--model-dir`` names another folder with a ``tokenizer.json``. Prints the
median over ``--repeat`` runs, in microseconds:

- per text, by its length: ``encode`` (what the counter called before), the counter's
  ``count`` (the fast form: no offsets), and a text it counted lately (``known``);
- a chat conversation of 20 turns (a 120-word user message and a 120-word answer each, cut to
  half of admission's inline limit, ``INLINE_CHARS``, where the docs' words run long): the
  prompt's count at turns 1, 5, 10 and 20, every text counted each time against
  ``count_texts`` with the counter's memory of recent texts (each turn brings two texts it
  has not seen: the last answer and the new question, counted inline).

Figures, never assertions: compare medians of runs on the same machine.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from tokenizers import Tokenizer

from admission.tokens import INLINE_CHARS, TokenizerCounter, count_texts
from workers.model import prepare_in_subprocess

_DOCS = Path(__file__).resolve().parent.parent / "docs" / "ARCHITECTURE.md"
_LENGTHS = (10, 100, 1_000, 4_000)
"""Words per text measured alone."""
_TURNS = 20
_WORDS_PER_MESSAGE = 120
_SHOWN_TURNS = (1, 5, 10, 20)


def corpus_words() -> list[str]:
    return _DOCS.read_text().split()


def texts_of(words: list[str], num_words: int, count: int) -> list[str]:
    """``count`` distinct texts of ``num_words`` words each, taken along the corpus."""
    step = max(1, (len(words) - num_words) // count)
    return [" ".join(words[i * step : i * step + num_words]) for i in range(count)]


def within(text: str, max_chars: int) -> str:
    """``text`` cut after its last word that ends within ``max_chars`` characters."""
    return text if len(text) <= max_chars else text[: max_chars + 1].rsplit(" ", 1)[0]


def median_us(call: Callable[[str], object], batches: list[list[str]]) -> float:
    """The median over ``batches`` of ``call``'s time per text, in microseconds."""
    times = []
    for batch in batches:
        start = time.perf_counter()
        for text in batch:
            call(text)
        times.append((time.perf_counter() - start) / len(batch) * 1e6)
    return statistics.median(times)


def fresh(texts: list[str]) -> list[str]:
    """``texts`` as new strings: a new request's text is a new string, whose hash is computed
    again."""
    return [text.encode().decode() for text in texts]


def fresh_copies(texts: list[str], repeat: int) -> list[list[str]]:
    return [fresh(texts) for _ in range(repeat)]


def per_text(tokenizer_file: Path, words: list[str], repeat: int) -> None:
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    print(f"{'words':>6} {'chars':>7} {'encode':>10} {'count':>10} {'known':>8}  (us per text)")
    for num_words in _LENGTHS:
        texts = texts_of(words, num_words, 20 if num_words >= 1_000 else 200)
        batches = fresh_copies(texts, repeat)
        counter = TokenizerCounter(tokenizer_file)
        encode = median_us(partial(tokenizer.encode, add_special_tokens=False), batches)
        count = median_us(counter.count, batches)
        for text in texts:
            counter.remember(text, counter.count(text))
        known = median_us(counter.known, fresh_copies(texts, repeat))
        chars = statistics.mean(len(t) for t in texts)
        print(f"{num_words:>6} {chars:>7.0f} {encode:>10.1f} {count:>10.1f} {known:>8.2f}")


def conversation(tokenizer_file: Path, words: list[str], repeat: int) -> None:
    # A turn's two new texts stay within the inline limit whatever the docs' words are (a
    # long command line in them would otherwise send the count to a thread).
    messages = [
        within(message, INLINE_CHARS // 2)
        for message in texts_of(words, _WORDS_PER_MESSAGE, 2 * _TURNS)
    ]
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    for message in messages:
        tokenizer.encode(message, add_special_tokens=False)
    every_text: dict[int, list[float]] = {turn: [] for turn in _SHOWN_TURNS}
    remembered: dict[int, list[float]] = {turn: [] for turn in _SHOWN_TURNS}
    for _ in range(repeat):
        # Nothing remembered yet, and the tokenizer's own cache of words as warm as the one
        # the other column uses (it counted these texts before).
        counter = TokenizerCounter(tokenizer_file)
        for message in messages:
            counter.count(message)
        for turn in range(1, _TURNS + 1):
            prompt = fresh(messages[: 2 * turn - 1])
            elapsed = _timed_count(counter, prompt)
            if turn in remembered:
                remembered[turn].append(elapsed)
                start = time.perf_counter()
                for text in prompt:
                    tokenizer.encode(text, add_special_tokens=False)
                every_text[turn].append((time.perf_counter() - start) * 1e6)
    print(f"\nchat conversation, {_WORDS_PER_MESSAGE} words a message (us per request)")
    print(f"{'turn':>5} {'messages':>9} {'every text':>11} {'remembered':>11}")
    for turn in _SHOWN_TURNS:
        every, kept = statistics.median(every_text[turn]), statistics.median(remembered[turn])
        print(f"{turn:>5} {2 * turn - 1:>9} {every:>11.1f} {kept:>11.1f}")


def _timed_count(counter: TokenizerCounter, prompt: list[str]) -> float:
    """``count_texts`` on ``prompt``, in microseconds (inline: the turn's new texts are short)."""
    coroutine = count_texts(counter, prompt)
    start = time.perf_counter()
    try:
        coroutine.send(None)
    except StopIteration:
        return (time.perf_counter() - start) * 1e6
    coroutine.close()
    raise RuntimeError("counting went to a thread: the new texts were past the inline limit")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument(
        "--model-dir", type=Path, help="a folder with tokenizer.json (default: the bundled model)"
    )
    args = parser.parse_args(argv)
    model_dir = args.model_dir or prepare_in_subprocess(None, None).path
    tokenizer_file = model_dir / "tokenizer.json"
    print(f"tokenizer: {tokenizer_file}")
    words = corpus_words()
    per_text(tokenizer_file, words, args.repeat)
    conversation(tokenizer_file, words, args.repeat)


if __name__ == "__main__":
    main()
