"""Every type that crosses a boundary between the rollout loop, the worker process and the trainer.

Field names follow the spec's API reference (TurnRecord, Rollout, RolloutGroup); TrainingSequence, RolloutSample,
PromptDone and EndOfBatch are what crosses the process boundary (pickled through the rollout queue, channels.py).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from asyncrl.prompts import Messages

if TYPE_CHECKING:
    import torch


@dataclass
class TurnRecord:
    """One sampling request. Produced by ``AsyncRolloutLoop.generate_one_turn``; consumed by reconciliation."""

    prompt_ids: list[int]
    output_ids: list[int]
    output_log_probs: list[float] = field(default_factory=list)
    output_mask: list[int] | None = None
    """1 = train on the token, 0 = context only; None = every output token is trained."""
    output_sampling_mask: list[list[int]] | None = None
    """Per output token: the candidate ids it was drawn from under top-k/top-p/min-p; None = full vocabulary."""
    output_sampler_logprobs: list[dict[int, float]] | None = None
    """Per output token: the sampler's top log-probabilities by token id (score centering)."""
    finish_reason: str = "stop"
    """stop (EOS or stop token), length (budget or context), abort."""
    images: PromptImages | None = None
    """The patches of the images in ``prompt_ids`` (rollout/images.py); None for a text-only prompt."""


@dataclass
class Rollout:
    """One finished conversation. Produced by ``generate_one``; consumed by group scoring."""

    completion: Messages | str
    """The assistant's messages; the text alone for a standard (string) prompt."""
    completion_ids: list[int]
    turns: list[TurnRecord]
    tool_call_count: int = 0
    tool_failure_count: int = 0
    reward: float | None = None
    """Added to the reward functions' sum; None = no reward from this source."""
    env_reward: tuple[type, float] | None = None
    """(environment class, its get_reward()) when the rollout ran in an environment that scores itself."""
    env: Any = None
    """The environment instance it ran in (rollout.environment_factory), its until the group is scored: the reward
    functions get them as ``environments``."""
    tool_stats: Any = None
    """asyncrl.rollout.tools.ToolStats when the rollout had tools (the tools/* metrics); None otherwise."""
    rollout_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    @property
    def truncated(self) -> bool:
        """The last turn ended on the length budget or an abort rather than a stop."""
        return bool(self.turns) and self.turns[-1].finish_reason != "stop"


@dataclass(frozen=True, eq=False)
class PromptImages:
    """The image processor's outputs for the images of a sample's prompt, in prompt order: they travel with the
    sample's tokens to the trainer, whose packed forward runs them through the vision tower (packing/images.py).
    The built-in server's prefill inputs (engine/images.py) and a packed row's images (packing/row.py) extend it.
    Compared by identity: a group's rollouts share one."""

    pixel_values: torch.Tensor
    """[patches, features]: every image's flattened patches, one image after the other (t * h * w rows each)."""
    image_grid_thw: torch.Tensor
    """[images, 3] long: each image's patch grid (t, h, w) before merging."""
    token_id: int
    """The placeholder token (the model's config.image_token_id): each image stands in the sample's tokens as one
    contiguous run of t * h * w / merge_size**2 of them, one per merged patch."""
    merge_size: int
    """The vision tower's spatial_merge_size (the processor's merge_size)."""

    def expand(self, prompt_ids: Sequence[int]) -> list[int]:
        """The rendered prompt with each image's one placeholder repeated once per merged patch, as Qwen's processor
        expands it: the built-in server and the rollout side (which checks vLLM's prompt) expand alike."""
        counts = iter((self.image_grid_thw.prod(-1) // self.merge_size**2).tolist())
        return [t for token in prompt_ids for t in ([token] * next(counts) if token == self.token_id else [token])]


@dataclass
class TrainingSequence:
    """Tokens of one training sample, built from a rollout's turns by reconciliation.

    ``mask[i] == 1`` means token i is trained: the loss scores it from position i - 1, against
    ``sampler_logprobs[i]`` (and ``sampler_top_logprobs[i]`` / ``sampling_masks[i]`` when present).
    """

    token_ids: list[int]
    mask: list[int]
    sampler_logprobs: list[float]
    sampler_top_logprobs: list[dict[int, float] | None] | None = None
    sampling_masks: list[list[int] | None] | None = None
    truncated: bool = False
    """The rollout's last turn did not end on a stop (length budget or abort): mask_truncated_completions drops it."""
    images: PromptImages | None = None
    """The prompt's images, whose placeholders are in ``token_ids``; None for a text-only sample."""

    @property
    def num_trained(self) -> int:
        return int(sum(self.mask))


@dataclass
class RolloutGroup:
    """The num_generations rollouts of one prompt, scored together (one entry per rollout in each list)."""

    prompts: list[Messages] | list[str]
    """Conversations, or plain texts for a dataset of standard (string) prompts, whose completions are texts."""
    reward_kwargs: dict[str, list[Any]]
    completions: list[Messages] | list[str]
    completions_ids: list[list[int]]
    completions_sequences: list[list[TrainingSequence]]
    tool_call_counts: list[int]
    tool_failure_counts: list[int]
    model_version: int
    group_id: int
    row_index: int
    env_rewards: list[tuple[type, float] | None]
    rollout_rewards: list[float | None]
    queued_at: float = 0.0
    rewards: np.ndarray | None = None
    reward_components: dict[str, np.ndarray] = field(default_factory=dict)
    """Per reward source, one reward per rollout (NaN = not applicable), unweighted; ``rewards`` is their sum,
    weighted by reward_weights."""
    rollouts: list[Rollout] = field(default_factory=list)
    reward_metrics: dict[str, list[float]] = field(default_factory=dict)
    """What the reward functions logged through their ``log_metric`` argument, by name (the run's metrics)."""
    extra_columns: dict[str, list[Any]] = field(default_factory=dict)
    """What they logged through ``log_extra``: one value per rollout, by column (the completions table)."""


@dataclass
class RolloutSample:
    """One trainable sequence. Produced by the worker's group scoring; consumed by the trainer's packer."""

    sequence: TrainingSequence
    advantage: float
    reward: float
    group_id: int
    row_index: int
    """Dataset row of the prompt."""
    prompt_index: int
    """Global position in the prompt stream (epoch * num_rows + position): the resume cursor's unit."""
    model_version: int
    rollout_id: str
    epoch: int = 0
    group_std: float = 0.0
    """Std of the summed reward within the sample's group (the `reward_group_std` metric)."""
    reward_components: dict[str, float] = field(default_factory=dict)
    """Per reward function: this rollout's reward and its group std (`rewards/<fn>/group_std`)."""
    queued_at: float = 0.0
    """time.time() when the worker queued it (time.time: comparable across processes)."""

    @property
    def num_tokens(self) -> int:
        return len(self.sequence.token_ids)

    @property
    def num_trained(self) -> int:
        return self.sequence.num_trained


@dataclass(frozen=True)
class EndOfBatch:
    """Queue marker from the worker in synchronous mode (max_staleness=0): the step's samples are all queued. Also
    the last item when the worker's prompts end."""

    model_version: int
    solved: str = ""
    """Set when the prompts ended because every one was retired (data.retire_solved_after): the line saying so."""


@dataclass(frozen=True)
class PromptDone:
    """A prompt that produced no sample (filtered, or its group dropped): it still counts as consumed."""

    prompt_index: int
    reason: str
    """filtered | retired | zero_std | too_few_scorable | failed | prompt_too_long"""
    rewards: tuple[str, ...] = ()
    """The reward sources that left the group without signal (constant, or None for its rollouts)."""
    detail: str = ""
    """What happened, for the error that stops a run whose groups all drop (trainer/group_watch.py)."""
    reward: float | None = None
    """zero_std: the reward every rollout scored (whether the task is solved: rollout/solved.py)."""
