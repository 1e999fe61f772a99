"""The packed row: what one rank forwards in one micro-batch, whatever packer laid it out.

A row is a set of *segments* over a flat token layout. Each segment owns the query positions
``[q_start, q_end)`` and attends to ``kv_index`` (its root-to-segment path, itself last), causally with
bottom-right alignment. Flat packing is the case where every segment's path is itself. Every trained
token of every original sample gets one loss slot: ``token_index`` says which layout position predicts it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from asyncrl.rollout.types import PromptImages, RolloutSample


@dataclass
class Segment:
    q_start: int
    q_end: int
    kv_index: torch.Tensor
    """Layout positions this segment's queries may attend to, ending with its own q_start..q_end."""

    def keys_within(self, window: int | None) -> torch.Tensor:
        """The path keys some query sees under a sliding window (a query sees itself and the window - 1 tokens
        before it; None: the whole path): its own tokens and at most window - 1 before them. A path holds one
        token per position, so the window's reach is a suffix of it."""
        if window is None:
            return self.kv_index
        reach = self.q_end - self.q_start + window - 1
        return self.kv_index[max(0, int(self.kv_index.numel()) - reach) :]


@dataclass(frozen=True)
class PathKeys:
    """Each segment's query and key counts as one varlen call lays them out, and where its keys come from."""

    q_lens: list[int]
    k_lens: list[int]
    gather: torch.Tensor | None
    """Layout positions of every segment's keys, concatenated; None where each segment's keys are its own tokens
    (the layout as it is: flat rows, nothing to copy)."""


def path_keys(segments: list[Segment], window: int | None = None) -> PathKeys:
    """The keys of each segment's queries, within ``window`` (Segment.keys_within)."""
    keys = [seg.keys_within(window) for seg in segments]
    q_lens = [seg.q_end - seg.q_start for seg in segments]
    k_lens = [int(k.numel()) for k in keys]
    gather = torch.cat(keys) if keys else torch.zeros(0, dtype=torch.long)
    identity = q_lens == k_lens and bool(torch.equal(gather, torch.arange(gather.numel())))
    return PathKeys(q_lens, k_lens, None if identity else gather)


@dataclass(frozen=True)
class RowImages(PromptImages):
    """What a row with images gives the model beyond its tokens: built by the packers, read by the forward
    (packing/images.py). Its pixel values and grids are the row's images, each once, in the layout order of their
    placeholders."""

    layouts: list[tuple[int, torch.Tensor]]
    """Per sample with images: its index in the row's samples and the layout position of each of its tokens."""
    positions: torch.Tensor
    """[P / merge_size**2] long: the layout positions of the images' placeholders, one per merged patch, in order."""


@dataclass
class PackedRow:
    input_ids: torch.Tensor  # [L] long
    position_ids: torch.Tensor  # [L] long: depth in the sample (trie depth for tree packing)
    segments: list[Segment]
    token_index: torch.Tensor  # [T] long: layout position whose logits predict each trained token
    target_ids: torch.Tensor  # [T] long
    sequence_index: torch.Tensor  # [T] long: sample of the row each loss slot belongs to
    advantages: torch.Tensor  # [T] float
    sampler_logprobs: torch.Tensor  # [T] float
    top_ids: torch.Tensor | None = None  # [T, K] long: sampler's top-K token ids (0 where padded)
    sampler_top_logprobs: torch.Tensor | None = None  # [T, K] float, -inf where padded
    sampling_masks: list[list[int] | None] | None = None  # [T] candidate sets (top-k/top-p), None = full vocab
    samples: list[RolloutSample] = field(default_factory=list)
    images: RowImages | None = None
    """The samples' images, each once, and what their M-RoPE positions need (packing/images.py); None: text only."""
    dummy_image: bool = False
    """A text row whose micro-batch has images on another rank (trainer/distributed.py::split_rows): its forward
    runs the vision tower on a dummy image, weighted zero, so that the ranks' FSDP collectives pair up
    (packing/images.py)."""

    @property
    def num_forwarded(self) -> int:
        return int(self.input_ids.numel())

    @property
    def num_raw_tokens(self) -> int:
        return sum(s.num_tokens for s in self.samples)

    @property
    def num_trained(self) -> int:
        return int(self.target_ids.numel())

    def attention_cost(self) -> int:
        """Sum over segments of queries x keys: the O(L^2) work that balances rows across ranks."""
        return sum((seg.q_end - seg.q_start) * int(seg.kv_index.numel()) for seg in self.segments)


def loss_slots(samples: list[RolloutSample], offsets: list[list[int]], top_k: int) -> dict[str, torch.Tensor | list]:
    """Per trained token of each sample: target, predicting position, advantage, sampler data.

    ``offsets[s][i]`` is the layout position of token i of sample s; token i (i >= 1, mask 1) is
    predicted by the position of token i - 1.
    """
    token_index, targets, seq_index, advantages, logprobs = [], [], [], [], []
    top_ids, top_lps, masks = [], [], []
    for s, (sample, positions) in enumerate(zip(samples, offsets, strict=True)):
        seq = sample.sequence
        for i in range(1, len(seq.token_ids)):
            if not seq.mask[i]:
                continue
            token_index.append(positions[i - 1])
            targets.append(seq.token_ids[i])
            seq_index.append(s)
            advantages.append(sample.advantage)
            logprobs.append(seq.sampler_logprobs[i])
            if top_k:
                ids, lps = _top_entry(seq.sampler_top_logprobs[i] if seq.sampler_top_logprobs else None, top_k)
                top_ids.append(ids)
                top_lps.append(lps)
            masks.append(seq.sampling_masks[i] if seq.sampling_masks else None)
    out: dict[str, torch.Tensor | list] = {
        "token_index": torch.tensor(token_index, dtype=torch.long),
        "target_ids": torch.tensor(targets, dtype=torch.long),
        "sequence_index": torch.tensor(seq_index, dtype=torch.long),
        "advantages": torch.tensor(advantages, dtype=torch.float32),
        "sampler_logprobs": torch.tensor(logprobs, dtype=torch.float32),
        "sampling_masks": masks if any(m is not None for m in masks) else None,
    }
    if top_k:
        out["top_ids"] = torch.tensor(top_ids, dtype=torch.long).reshape(-1, top_k)
        out["sampler_top_logprobs"] = torch.tensor(top_lps, dtype=torch.float32).reshape(-1, top_k)
    return out


def _top_entry(entry: dict[int, float] | None, k: int) -> tuple[list[int], list[float]]:
    """The k most likely (id, logprob) pairs, padded with (0, -inf)."""
    pairs = sorted((entry or {}).items(), key=lambda kv: -kv[1])[:k]
    ids = [token for token, _ in pairs] + [0] * (k - len(pairs))
    lps = [lp for _, lp in pairs] + [float("-inf")] * (k - len(pairs))
    return ids, lps
