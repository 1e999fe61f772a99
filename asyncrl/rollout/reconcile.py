"""Turns -> training sequences: a turn whose prompt extends the held tokens continues the sequence;
any other turn starts a new one (spec 001: every generated token is trained in exactly one sample).

There is no REALIGN (rewrite the held tokens to the new rendering) and no ``fork_threshold_tokens``: both
turn already-generated tokens into context or train tokens the sampler never produced, which breaks the
promise above; a fork costs forward tokens (``rollout/drift_tokens_*``) but no training signal.
"""

from __future__ import annotations

import itertools

from asyncrl.rollout.types import TrainingSequence, TurnRecord


def reconcile(turns: list[TurnRecord]) -> list[TrainingSequence]:
    sequences: list[TrainingSequence] = []
    current: TrainingSequence | None = None
    for turn in turns:
        held = current.token_ids if current is not None else None
        if held is not None and turn.prompt_ids[: len(held)] == held:
            _append(current, turn.prompt_ids[len(held) :], context=True)  # type: ignore[arg-type]
            if turn.images is not None:  # the conversation's images so far: the held ones and a tool result's
                current.images = turn.images  # type: ignore[union-attr]
        else:
            current = TrainingSequence(token_ids=[], mask=[], sampler_logprobs=[], sampler_top_logprobs=[],
                                       sampling_masks=[], images=turn.images)  # fmt: skip
            sequences.append(current)
            _append(current, turn.prompt_ids, context=True)
        _append_output(current, turn)
    return [seq for seq in sequences if seq.num_trained > 0]


def drift(turns: list[TurnRecord]) -> list[int]:
    """Per turn boundary: 0 when the next prompt extends the held tokens, else how many held tokens it
    re-rendered (held length minus the common prefix), which is what the fork adds to the forward."""
    out = []
    for previous, turn in itertools.pairwise(turns):
        held = previous.prompt_ids + previous.output_ids  # what the sequence holds after `previous`, fork or not
        out.append(len(held) - _common_prefix(held, turn.prompt_ids))
    return out


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _append(seq: TrainingSequence, token_ids: list[int], *, context: bool) -> None:
    seq.token_ids.extend(token_ids)
    seq.mask.extend([0] * len(token_ids))
    seq.sampler_logprobs.extend([0.0] * len(token_ids))
    seq.sampler_top_logprobs.extend([None] * len(token_ids))  # type: ignore[union-attr]
    seq.sampling_masks.extend([None] * len(token_ids))  # type: ignore[union-attr]


def _append_output(seq: TrainingSequence, turn: TurnRecord) -> None:
    n = len(turn.output_ids)
    mask = turn.output_mask if turn.output_mask is not None else [1] * n
    if any(mask) and len(turn.output_log_probs) != n:
        raise ValueError(f"TurnRecord has {n} output_ids but {len(turn.output_log_probs)} output_log_probs")
    seq.token_ids.extend(turn.output_ids)
    seq.mask.extend(int(m) for m in mask)
    seq.sampler_logprobs.extend(turn.output_log_probs or [0.0] * n)
    seq.sampler_top_logprobs.extend(turn.output_sampler_logprobs or [None] * n)  # type: ignore[union-attr]
    seq.sampling_masks.extend(turn.output_sampling_mask or [None] * n)  # type: ignore[union-attr]
