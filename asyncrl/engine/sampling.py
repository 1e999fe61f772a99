"""One decoding step's sampling for a batch of rows, each with its own settings and random stream.

The order follows vLLM's V1 sampler: stop ids suppressed under ``min_tokens`` -> repetition penalty ->
temperature -> min-p -> top-k -> top-p. Reported logprobs are the log-softmax of the result, i.e. of the
distribution actually sampled from (vLLM ``--logprobs-mode processed_logprobs``): normalised over the
candidate set, -inf outside it. Greedy rows (temperature below 1e-5) take the argmax and are processed exactly like
temperature 1, so their logprobs do not depend on which other rows share the batch.

Each row draws by inverse CDF with one uniform number per step from its request's own seeded stream (``uniform``):
the batch samples in a few tensor operations, where drawing vocabulary-sized noise from a generator per row cost a
kernel launch per row, and a request's tokens still depend on its seed alone, never on its neighbours.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch

from asyncrl.sampling import SamplingParams

LOGPROB_FLOOR = -9999.0


@dataclass(frozen=True, slots=True)
class RowInput:
    """What the sampler needs from one row for one step."""

    params: SamplingParams
    uniform: float  # this step's draw in [0, 1) from the row's seeded stream (greedy rows ignore it)
    seen: torch.Tensor | None  # bool [vocab]: ids in prompt or output; needed only with a repetition penalty
    suppressed: Sequence[int] = ()  # ids forbidden this step (stop ids while under min_tokens)


@dataclass(frozen=True, slots=True)
class Draw:
    """One row's draw as its host copy: ``ids`` is the sampled token then the most likely tokens by rank,
    ``values`` their processed logprobs, at least ``wanted`` of them (the request's top logprobs; None: it asked
    for none); ``candidate_ids`` its candidate set. Rows keep these lists whole, so a step allocates few objects
    for the garbage collector to track."""

    ids: list[int]
    values: list[float]
    wanted: int | None
    candidate_ids: list[int] | None

    @property
    def token_id(self) -> int:
        return self.ids[0]

    @property
    def logprob(self) -> float:
        return self.values[0]

    @property
    def top_logprobs(self) -> list[tuple[int, float]] | None:
        return None if self.wanted is None else top_logprobs(self.ids, self.values, self.wanted)


def top_logprobs(ids: list[int], values: list[float], wanted: int) -> list[tuple[int, float]]:
    """The ``wanted`` most likely (id, logprob) of a draw's host copy (``Draw.ids``, ``Draw.values``), by rank."""
    return list(zip(ids[1 : wanted + 1], values[1 : wanted + 1], strict=True))


def process_logits(logits: torch.Tensor, rows: Sequence[RowInput]) -> torch.Tensor:
    """Return float32 logits after every per-row processor; removed tokens are -inf."""
    logits = logits.float().clone()
    for i, row in enumerate(rows):
        if row.suppressed:
            logits[i, list(row.suppressed)] = float("-inf")
    _apply_repetition_penalty(logits, rows)
    # an extreme penalty or temperature overflows float32: +inf is the largest logit, NaN (0 x inf) a removed one
    logits.nan_to_num_(nan=float("-inf"), posinf=torch.finfo(torch.float32).max)
    temperatures = [1.0 if row.params.greedy else row.params.temperature for row in rows]
    if any(t != 1.0 for t in temperatures):
        logits /= torch.tensor(temperatures, device=logits.device).unsqueeze(1)
    _apply_min_p(logits, rows)
    _apply_top_k_top_p(logits, rows)
    return logits


def _row_index(keep: list[bool], device: torch.device) -> torch.Tensor | None:
    indices = [i for i, flag in enumerate(keep) if flag]
    return torch.tensor(indices, device=device) if indices else None


def _apply_repetition_penalty(logits: torch.Tensor, rows: Sequence[RowInput]) -> None:
    """vLLM/CTRL penalty on ids seen in prompt or output: positive logits divided, negative multiplied."""
    keep = [row.params.repetition_penalty != 1.0 for row in rows]
    index = _row_index(keep, logits.device)
    if index is None:
        return
    selected = [row for row, flag in zip(rows, keep, strict=True) if flag]
    seen = torch.stack([row.seen for row in selected])
    penalty = torch.tensor([row.params.repetition_penalty for row in selected], device=logits.device)
    sub = logits[index]
    penalised = torch.where(sub > 0, sub / penalty.unsqueeze(1), sub * penalty.unsqueeze(1))
    logits[index] = torch.where(seen, penalised, sub)


def _apply_min_p(logits: torch.Tensor, rows: Sequence[RowInput]) -> None:
    """Drop tokens whose probability is below min_p times the most likely token's."""
    keep = [row.params.min_p > 0.0 for row in rows]
    index = _row_index(keep, logits.device)
    if index is None:
        return
    min_p = torch.tensor([r.params.min_p for r, k in zip(rows, keep, strict=True) if k], device=logits.device)
    sub = logits[index]
    probs = sub.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    logits[index] = sub.masked_fill(probs < threshold, float("-inf"))


def _apply_top_k_top_p(logits: torch.Tensor, rows: Sequence[RowInput]) -> None:
    """Keep the k largest logits (ties at the k-th kept), then the smallest prefix holding top_p of the mass."""
    vocab = logits.shape[1]
    keep = [0 < row.params.top_k < vocab or row.params.top_p < 1.0 for row in rows]
    index = _row_index(keep, logits.device)
    if index is None:
        return
    selected = [row.params for row, flag in zip(rows, keep, strict=True) if flag]
    top_k = torch.tensor([s.top_k if 0 < s.top_k < vocab else vocab for s in selected], device=logits.device)
    top_p = torch.tensor([s.top_p for s in selected], device=logits.device).unsqueeze(1)
    values, order = logits[index].sort(dim=-1, descending=True)
    kth = values.gather(1, (top_k - 1).unsqueeze(1))
    values = values.masked_fill(values < kth, float("-inf"))
    probs = values.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    beyond = (mass_before >= top_p) & (top_p < 1.0)
    beyond[:, 0] = False  # the most likely token always stays, as in vLLM (a top_p that is 0 in float32)
    values = values.masked_fill(beyond, float("-inf"))
    logits[index] = torch.empty_like(values).scatter_(1, order, values)


def sample_step(logits: torch.Tensor, rows: Sequence[RowInput]) -> list[Draw]:
    """Sample one token per row from ``logits`` [rows, vocab] and report what the response needs."""
    processed = process_logits(logits, rows)
    logprobs = processed.log_softmax(dim=-1)
    greedy = torch.tensor([row.params.greedy for row in rows], device=logprobs.device)
    tokens = torch.where(greedy, processed.argmax(dim=-1), _inverse_cdf(logprobs, [row.uniform for row in rows]))
    sampled = logprobs.gather(1, tokens.unsqueeze(1))
    wanted = [row.params.logprobs for row in rows]
    most = min(max((n or 0 for n in wanted), default=0), logprobs.shape[1])
    top_values, top_ids = logprobs.topk(most, dim=-1)
    # two device-to-host copies a step: each row's token and top ids, then its logprob and top logprobs
    ids = torch.cat([tokens.unsqueeze(1), top_ids], dim=1).tolist()
    values = torch.cat([sampled, top_values], dim=1).clamp(min=LOGPROB_FLOOR).tolist()
    masked = [i for i, row in enumerate(rows) if row.params.return_sampling_mask and row.params.truncates]
    candidates = dict(zip(masked, _candidate_ids(processed, masked), strict=True))
    return [
        Draw(row_ids, row_values, n, candidates.get(i))
        for i, (row_ids, row_values, n) in enumerate(zip(ids, values, wanted, strict=True))
    ]


def _inverse_cdf(logprobs: torch.Tensor, uniforms: list[float]) -> torch.Tensor:
    """Per row, the first token whose cumulative probability exceeds ``uniform`` times the row's total. Summed in
    float64, so rounding moves no token's share measurably; a token of probability zero has no width and is never
    drawn."""
    cdf = logprobs.double().exp().cumsum(dim=-1)
    total = cdf[:, -1]
    targets = torch.tensor(uniforms, dtype=torch.float64, device=cdf.device) * total
    # uniform x total can round up to the total itself: keep the target below it, so some token exceeds it
    targets = torch.minimum(targets, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, targets.unsqueeze(1), right=True).squeeze(1)


def _candidate_ids(processed: torch.Tensor, indices: list[int]) -> list[list[int]]:
    """The finite (candidate) token ids of each row in ``indices``, copied to the host once for all of them."""
    if not indices:
        return []
    finite = torch.isfinite(processed[torch.tensor(indices, device=processed.device)])
    counts = finite.sum(dim=1).tolist()
    ids = finite.nonzero()[:, 1].tolist()
    return [ids[end - count : end] for count, end in zip(counts, accumulate(counts), strict=True)]
