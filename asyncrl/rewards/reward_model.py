"""Reward models in ``reward_funcs``, as TRL's GRPOTrainer takes them: ``{name: reward_model, path: CHECKPOINT}``
names a sequence-classification checkpoint (num_labels=1) whose logit on prompt + completion is the reward.

Where it runs. The rollout worker scores every group, but it has no GPU (rollout/spawn.py hides them) and must keep
none. The classifier is loaded instead in the trainer's rank-0 process, on its device, and served there on a
loopback HTTP endpoint (rewards/endpoint.py); this ``RewardModel`` is the worker's side of it, an async reward that
sends each group's prompts and completions in one request and gets one reward per completion back. So:

- GPU memory stays accounted for: the classifier's weights sit on the trainer's GPU before the warm-up step
  measures the trainer's footprint, from which a vLLM sharing that GPU gets its share (trainer/memory.py). A
  separate scoring process would hold memory that neither the measurement nor vLLM's share knows of.
- No new process to launch, supervise, log and restart: the endpoint lives and dies with the trainer, and a restart
  loads it again.
- The worker's pipeline is unchanged: the reward model is one more async source, awaited beside the functions
  (rollout/scoring.py), weighed by ``reward_weights`` and logged as ``rewards/<name>/mean``, where ``name`` is the
  checkpoint's last path component, as TRL names it. Its forward shares rank 0's GPU with training: one group is a
  small batch, and ``batch_size`` bounds what a large evaluation adds beyond the measured footprint.

The endpoint loads nothing on request (the checkpoints load when it starts), listens on 127.0.0.1 only and answers
only requests carrying its per-run random token, which reaches the worker inside its spec.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from asyncrl.config.schema import ModelDtype
from asyncrl.rewards.base import REWARDS, Reward

if TYPE_CHECKING:
    from asyncrl.config.schema import Config


@dataclass(frozen=True)
class RewardModelOptions:
    path: str = ""
    """Hub id or local directory (save_pretrained layout) of a *ForSequenceClassification checkpoint with
    num_labels=1, its tokenizer beside it; its chat template renders conversational prompts. It loads with
    model.trust_remote_code, as TRL loads reward models with its one trust_remote_code."""
    revision: str | None = None
    """Branch, tag or commit of ``path`` on the Hub (from_pretrained's revision); null: its default branch. Not
    model.revision, which pins the policy's repository: a commit of one repository names nothing in another."""
    tokenizer: str | None = None
    """Hub id or local directory of the tokenizer (and chat template) the reward model reads with, TRL's
    reward_processing_classes; null: the one beside the checkpoint (TRL's default)."""
    dtype: ModelDtype = ModelDtype.float32
    """Weights dtype: float32 (TRL's default) | bfloat16 | float16 | auto (as the checkpoint stores them)."""
    batch_size: int = 32
    """Sequences per forward: bounds the activations the scoring adds on the trainer's GPU."""

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("needs path=CHECKPOINT (a sequence-classification checkpoint's directory or Hub id)")
        if self.batch_size < 1:
            raise ValueError(f"batch_size={self.batch_size} must be >= 1")


@dataclass(frozen=True)
class ScoringEndpoint:
    """Where the worker sends a reward model's requests: set by the trainer once the endpoint listens."""

    url: str
    token: str
    timeout_s: float


class RewardModelError(RuntimeError):
    """The scoring endpoint failed or is not there; the message says which."""


@REWARDS.register("reward_model")
class RewardModel(Reward):
    """A sequence classifier's logit as the reward, computed where the trainer's GPU is (the module docstring)."""

    Options = RewardModelOptions
    options: RewardModelOptions
    endpoint: ScoringEndpoint | None = None

    @property
    def metric_name(self) -> str:
        """TRL's name for a reward model: the last component of its path (``rewards/<name>/mean``)."""
        return Path(self.options.path.rstrip("/")).name

    async def __call__(self, prompts: Sequence[Any], completions: Sequence[Any],
                       completion_ids: Sequence[Sequence[int]], **columns: Any) -> list[float | None]:  # fmt: skip
        """One request per group: the endpoint batches the forwards (``batch_size`` sequences each)."""
        if self.endpoint is None:
            raise RewardModelError(f"reward model {self.options.path} is not being served (the trainer serves it)")
        body = {"prompts": list(prompts), "completions": list(completions)}
        headers = {"Authorization": f"Bearer {self.endpoint.token}"}
        async with httpx.AsyncClient(timeout=self.endpoint.timeout_s, trust_env=False) as client:
            response = await client.post(self.endpoint.url, json=body, headers=headers)
        if response.status_code != 200:
            raise RewardModelError(f"the scoring endpoint answered HTTP {response.status_code}: {response.text[:300]}")
        return [float(reward) for reward in response.json()["rewards"]]


def reward_model_options(config: Config) -> list[tuple[str, RewardModelOptions]]:
    """The key and options of each reward model in ``config.reward_funcs``, for what reads a run's checkpoints before
    its components are built (the Hub check, the trainer's memory figure)."""
    built = ((f"reward_funcs[{index}]", REWARDS.build(spec)) for index, spec in enumerate(config.reward_funcs)
             if spec["name"] == "reward_model")  # fmt: skip
    return [(key, model.options) for key, model in built]
