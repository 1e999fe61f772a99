"""Sampling parameters: one type from the config through the client to the server's sampler.

``Decoding`` holds the knobs a run sets once (``config.sampling`` extends it with the run's other sampling keys);
``SamplingParams`` adds what one request sets: its token budget, logprobs, seed and stop ids. The client sends a
``SamplingParams`` field by field, the built-in server validates the HTTP body (engine/protocol.py, pydantic only
there) and turns it back into one for its sampler (engine/sampling.py).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

GREEDY_BELOW = 1e-5  # vLLM's sampling epsilon: lower temperatures decode greedily


@dataclass
class Decoding:
    """How each token is drawn, in vLLM's order: repetition penalty -> temperature -> min-p -> top-k -> top-p."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 = off. top_p < 1 or min_p > 0 need top_k > 0 (it bounds the candidate set)."""
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def truncates(self) -> bool:
        """Whether the candidate set can be smaller than the vocabulary."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


@dataclass
class SamplingParams(Decoding):
    """Every sampling field of one request; the client sends each one explicitly so server defaults never apply.

    ``logprobs`` is the number of top logprobs per token (0: the sampled token's only; None: none at all).
    ``max_tokens`` is the request's budget; the server caps it to its context window.
    """

    max_tokens: int = 16
    min_tokens: int = 0
    logprobs: int | None = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    return_sampling_mask: bool = False

    @classmethod
    def of(cls, decoding: Decoding, **request: Any) -> SamplingParams:
        """``decoding``'s knobs (e.g. config.sampling's) with this request's own fields, which win."""
        knobs = {field.name: getattr(decoding, field.name) for field in fields(Decoding)}
        return cls(**{**knobs, **request})
