"""A model the gateway serves: what requests resolve their ``model`` field to."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ServedModel:
    """A model the gateway serves, as ``/v1/models`` lists it."""

    name: str
    max_model_len: int | None
    created: int
    version: str | None = None
    """The exact weights served (price cards and measured cost are keyed by it); None: the
    name."""
    deployment: str = "default"
    """The deployment serving it (a rollout arm, in time)."""
    default_max_tokens: int | None = None
    """The output cap of a chat request that sets none (a plan's ``max_output_tokens`` wins);
    None: up to the context window, as OpenAI's API. See ``output_cap``."""
    kv_block_bytes: int | None = None
    """Bytes one KV block holds on its workers, to count what each transfer hands over; None
    when the model's shape is not known (external workers without a model folder)."""

    @property
    def output_cap(self) -> int | None:
        """``default_max_tokens``, within the context window."""
        if self.default_max_tokens is None:
            return None
        return self.within_window(self.default_max_tokens)

    def within_window(self, max_tokens: int) -> int:
        """``max_tokens`` no longer than the context window: the engine refuses a larger one
        (it shortens one that only the prompt pushes past the window)."""
        return max_tokens if self.max_model_len is None else min(max_tokens, self.max_model_len)

    def kv_bytes(self, num_blocks: int) -> int | None:
        """What ``num_blocks`` KV blocks hold, where the model's shape is known."""
        return None if self.kv_block_bytes is None else num_blocks * self.kv_block_bytes
