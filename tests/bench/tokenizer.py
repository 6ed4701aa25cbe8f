"""A tokenizer every machine has: byte-level BPE (the served model's family) trained on the
shipped prompts. CI does not prepare the bundled model before the fast tiers."""

from __future__ import annotations

import json
from functools import cache
from importlib import resources

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SHIPPED = [
    json.loads(line)["prompt"]
    for line in resources.files("bench.harness")
    .joinpath("data/chat_prompts.jsonl")
    .read_text(encoding="utf-8")
    .splitlines()
]


@cache
def trained_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=2000, initial_alphabet=alphabet, show_progress=False)
    tokenizer.train_from_iterator(SHIPPED, trainer)
    return tokenizer
