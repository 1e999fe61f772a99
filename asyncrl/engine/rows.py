"""A request as the engine sees it (``GenerationRequest``), its live decoding state (``DecodeRow``) and its outcome."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from asyncrl.engine.images import ImageInputs
from asyncrl.engine.sampling import Draw, RowInput, top_logprobs
from asyncrl.sampling import SamplingParams


@dataclass(frozen=True, slots=True)
class StopStrings:
    """A request's stop strings, matched as vLLM's detokenizer matches them: in the completion's text after each
    token, once min_tokens are out. Only the last tokens are decoded (a match ends with the newest token: the check
    ran after every earlier one); the token ids keep every generated token, the text is cut where the match starts."""

    strings: tuple[str, ...]
    decode: Callable[[Sequence[int]], str]

    def match(self, output_ids: Sequence[int]) -> str | None:
        """The first stop string in the text of the completion's last tokens, or None."""
        tail = self.decode(output_ids[-(max(map(len, self.strings)) + TAIL_SLACK_TOKENS) :])
        return next((stop for stop in self.strings if stop in tail), None)


TAIL_SLACK_TOKENS = 4
"""Tokens decoded beyond the longest stop string's length in characters (a token holds one character or more; a few
more cover tokens that decode to nothing, and a character split over two byte-level tokens)."""


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """A validated completion request; ``params.max_tokens`` is already capped to the context window."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    adapter: str | None = None
    """The LoRA adapter the request runs under (its ``model``); None: the base weights."""
    images: ImageInputs | None = None
    """The prompt's images (a chat request's image parts); None: text only."""
    stop: StopStrings | None = None
    """The request's stop strings; None: none."""


@dataclass(frozen=True, slots=True)
class GenerationResult:
    """Everything a completion response reports, per generated token where it is a list."""

    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None
    sampling_masks: list[list[int]] | None
    finish_reason: str
    stop_reason: int | str | None
    """The stop token id or stop string that ended it (vLLM's); None for EOS, length or abort."""


@dataclass(eq=False)
class DecodeRow:
    """One request being generated. The last output token is always pending: sampled but not yet cached."""

    request: GenerationRequest
    rng: random.Random
    """The request's own random stream, seeded with its seed: one uniform per sampled token."""
    future: Future[GenerationResult] = field(default_factory=Future)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    """Each token's ``Draw.ids`` and ``Draw.values``, kept whole when the request asked for top logprobs."""
    top_values: list[list[float]] = field(default_factory=list)
    sampling_masks: list[list[int]] = field(default_factory=list)
    cached_len: int = 0
    seen: torch.Tensor | None = None
    prompt_counted: bool = False
    stop_reason: int | str | None = None

    def tokens(self) -> list[int]:
        """Prompt and output so far: what a (re-)prefill feeds the model."""
        return self.request.prompt_ids + self.output_ids

    def sampling_input(self, eos_token_ids: frozenset[int], vocab_size: int, device: torch.device) -> RowInput:
        """This step's sampler input; stop ids are forbidden while fewer than min_tokens were generated."""
        params = self.request.params
        if params.repetition_penalty != 1.0 and self.seen is None:
            self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            self.seen[self.tokens()] = True
        suppressed: frozenset[int] = frozenset()
        if len(self.output_ids) < params.min_tokens:
            suppressed = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos_token_ids)
        return RowInput(params, self.rng.random(), self.seen, sorted(suppressed))

    def accept(self, draw: Draw, eos_token_ids: frozenset[int]) -> str | None:
        """Record a sampled token; return the finish reason if it ends the request."""
        self.output_ids.append(draw.token_id)
        self.logprobs.append(draw.logprob)
        if draw.wanted is not None:
            self.top_ids.append(draw.ids)
            self.top_values.append(draw.values)
        if draw.candidate_ids is not None:
            self.sampling_masks.append(draw.candidate_ids)
        if self.seen is not None:
            self.seen[draw.token_id] = True
        params = self.request.params
        if not params.ignore_eos and draw.token_id in eos_token_ids:
            return "stop"
        if draw.token_id in params.stop_token_ids:
            self.stop_reason = draw.token_id
            return "stop"
        stop = self.request.stop
        if stop is not None and len(self.output_ids) >= params.min_tokens and (hit := stop.match(self.output_ids)):
            self.stop_reason = hit
            return "stop"
        return "length" if len(self.output_ids) >= params.max_tokens else None

    def _top_logprobs(self, wanted: int) -> list[list[tuple[int, float]]]:
        pairs = zip(self.top_ids, self.top_values, strict=True)
        return [top_logprobs(ids, values, wanted) for ids, values in pairs]

    def finish(self, finish_reason: str) -> None:
        """Resolve the request's future with what was generated so far."""
        if self.future.done():
            return
        params = self.request.params
        masks = list(self.sampling_masks) if params.return_sampling_mask and params.truncates else None
        self.future.set_result(
            GenerationResult(
                request_id=self.request.request_id,
                prompt_ids=self.request.prompt_ids,
                token_ids=list(self.output_ids),
                logprobs=list(self.logprobs),
                top_logprobs=None if params.logprobs is None else self._top_logprobs(params.logprobs),
                sampling_masks=masks,
                finish_reason=finish_reason,
                stop_reason=self.stop_reason,
            )
        )
