"""Sampling parameters: one type from the config through the client to the server's sampler.

``Decoding`` holds the knobs a run sets once (``config.sampling`` extends it with the run's other sampling keys);
``SamplingParams`` adds what one request sets: its token budget, logprobs, seed and stop ids. The client sends a
``SamplingParams`` field by field, the built-in server validates the HTTP body (engine/protocol.py, pydantic only
there) and turns it back into one for its sampler (engine/sampling.py). The field sets below say which request fields
``sampling.generation_kwargs`` may add (config/validate.py and plan/assemble.py check them).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

GREEDY_BELOW = 1e-5  # vLLM's sampling epsilon: lower temperatures decode greedily


@dataclass
class Decoding:
    """How each token is drawn, in vLLM's order: repetition penalty -> temperature -> min-p -> top-k -> top-p; and
    what else each request asks of the server's sampler (structured outputs, generation_kwargs)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 = off. top_p < 1 or min_p > 0 need top_k > 0 (it bounds the candidate set)."""
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    """1 = off, the only value a training run accepts (config/validate.py's check_sampler_matches_trainer says why)."""
    structured_outputs_regex: str | None = None
    """vLLM's structured outputs (TRL's vllm_structured_outputs_regex): each completion matches this regular
    expression, sent as the request's ``structured_outputs: {regex: ...}`` (vLLM's only spelling since 0.12); the
    built-in server refuses it. The sampler then draws from the allowed tokens only, so each token's importance ratio
    carries the share of the model's probability that the pattern allowed at its position (at most 1; the
    sampling/sampling_logp_difference metric shows it)."""
    generation_kwargs: dict[str, Any] = field(default_factory=dict)
    """More fields of each generation request, sent as they are (TRL's generation_kwargs): for vLLM one of its
    sampling parameters (VLLM_SAMPLING_FIELDS), for the built-in server one of its request fields. A field asyncrl
    sets from a key of its own (REQUEST_FIELD_KEYS) or that reweights single tokens (REWEIGHTING_FIELDS) is refused."""

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


VLLM_SAMPLING_FIELDS = frozenset(
    {
        "n", "presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "top_k", "min_p",
        "seed", "stop", "stop_token_ids", "ignore_eos", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs",
        "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output", "structured_outputs",
        "logit_bias", "allowed_token_ids", "bad_words",
    }
)  # fmt: skip
"""vLLM's documented sampling parameters (``SamplingParams`` in vllm/sampling_params.py, 0.26 to 0.33) that its
/v1/completions also takes at the top level of the body: a request goes to that endpoint or to
/inference/v1/generate, whose ``sampling_params`` is a ``SamplingParams``, so a field must mean the same to both."""

REQUEST_FIELD_KEYS: dict[str, str | None] = {
    **{name: f"sampling.{name}" for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")},
    "max_tokens": "sampling.max_completion_length",
    "logprobs": "sampling.num_sampler_logprobs",
    "n": "sampling.num_generations",
    "structured_outputs": "sampling.structured_outputs_regex",
    **dict.fromkeys(("min_tokens", "seed", "stop_token_ids", "ignore_eos", "return_sampling_mask", "model", "prompt",
                     "stream", "echo", "return_token_ids", "return_tokens_as_token_ids")),
}  # fmt: skip
"""The request fields asyncrl sets itself, each from its config key (None: from the request, e.g. a seed per
rollout): the trainer computes its log-probs and reads each response from these values."""

REWEIGHTING_FIELDS = frozenset({"presence_penalty", "frequency_penalty", "logit_bias"})
"""Sampling parameters that move single tokens' probabilities, which the trainer's log-probs do not apply."""
