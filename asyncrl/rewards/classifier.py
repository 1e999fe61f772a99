"""A reward model's sequence classifier: the checks on its checkpoint, made before anything loads, and the scoring,
done as TRL's GRPOTrainer does it (the reward model's own tokenizer, with its chat template for a conversation of the
prompt's and the completion's messages, or prompt + completion for plain text; right-padded, no special tokens
added; the reward is logits[:, 0]).

Loaded on the trainer's rank 0 and called from its scoring endpoint's threads (rewards/endpoint.py); the module
docstring of rewards/reward_model.py says why there.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from asyncrl.config.errors import ConfigError
from asyncrl.dtypes import torch_dtype
from asyncrl.rewards.reward_model import RewardModelOptions

FIX = "a reward model is a *ForSequenceClassification checkpoint with num_labels=1 (TRL's RewardTrainer trains one)"


def check_checkpoint(options: RewardModelOptions, key: str) -> None:
    """One line naming ``key`` for a checkpoint that cannot be a reward model: a missing path, one that is not a
    sequence classifier (a causal LM would score with a freshly initialised, random head), or one with another number
    of labels. Reads config.json only; a Hub id that is not in the cache yet is checked by the Hub check
    (asyncrl/hub.py) and as it loads."""
    from transformers import AutoConfig

    from asyncrl.hub import is_hub_id

    where, local = f"{key}.path={options.path}", Path(options.path).expanduser()
    if not local.exists() and not is_hub_id(options.path):
        raise ConfigError(f"{where}: no such directory; give a sequence-classification checkpoint's directory "
                          "(save_pretrained layout) or its Hub id")  # fmt: skip
    try:
        config = AutoConfig.from_pretrained(options.path, local_files_only=True)
    except (OSError, ValueError) as error:
        if not local.exists():
            return
        raise ConfigError(f"{where}: not a checkpoint ({first_line(error)}); {FIX}") from error
    architectures = list(config.architectures or [])
    if not any(name.endswith("ForSequenceClassification") for name in architectures):
        what = " or ".join(architectures) or "checkpoint whose config.json names no architecture"
        raise ConfigError(f"{where} is a {what}, not a sequence classifier: {FIX}")
    if config.num_labels != 1:
        raise ConfigError(f"{where} has num_labels={config.num_labels}: the reward is its one logit; {FIX}")


def check_tokenizer(options: RewardModelOptions, key: str, conversational: bool) -> None:
    """The checkpoint's own tokenizer loads, with a chat template when the prompts are conversations."""
    tokenizer = load_tokenizer(options, key)
    if conversational and tokenizer.chat_template is None:
        raise ConfigError(f"{key}.path={options.path}: its tokenizer has no chat template to render the "
                          "conversational prompts and completions with; give a reward model whose tokenizer has one, "
                          "or plain-text prompts")  # fmt: skip


def load_tokenizer(options: RewardModelOptions, key: str) -> Any:
    """The reward model's tokenizer, its pad token the EOS where it has none (TRL's)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(options.path)
    except (OSError, ValueError) as error:
        raise ConfigError(f"{key}.path={options.path}: cannot load its tokenizer ({first_line(error)})") from error
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


class Classifier:
    """One reward model on its device. ``score`` may be called from several threads: one forward at a time."""

    def __init__(self, model: Any, tokenizer: Any, batch_size: int, chat_template_kwargs: dict[str, Any]) -> None:
        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size
        self.chat_template_kwargs = chat_template_kwargs
        self.lock = threading.Lock()

    def texts(self, prompts: Sequence[Any], completions: Sequence[Any]) -> list[str]:
        """What the classifier reads: the whole conversation through its chat template, or prompt + completion."""
        pairs = zip(prompts, completions, strict=True)
        if prompts and isinstance(prompts[0], str):
            return [prompt + completion for prompt, completion in pairs]
        return [self.tokenizer.apply_chat_template([*prompt, *completion], tokenize=False, **self.chat_template_kwargs)
                for prompt, completion in pairs]  # fmt: skip

    @torch.inference_mode()
    def score(self, prompts: Sequence[Any], completions: Sequence[Any]) -> list[float]:
        """One reward per completion, ``batch_size`` sequences a forward."""
        texts, rewards = self.texts(prompts, completions), []
        with self.lock:
            for start in range(0, len(texts), self.batch_size):
                chunk = texts[start : start + self.batch_size]
                batch = self.tokenizer(chunk, return_tensors="pt", padding=True, padding_side="right",
                                       add_special_tokens=False).to(self.model.device)  # fmt: skip
                rewards += self.model(**batch).logits[:, 0].float().tolist()
        return rewards


def load_classifier(options: RewardModelOptions, key: str, device: torch.device,
                    chat_template_kwargs: dict[str, Any]) -> Classifier:  # fmt: skip
    """The checkpoint as a sequence classifier with one label on ``device``; a weight it lacks (a head that would be
    initialised at random) is refused."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    AutoConfig.from_pretrained(options.path)  # a Hub id's config.json into the cache, where the check reads it
    check_checkpoint(options, key)
    tokenizer = load_tokenizer(options, key)
    dtype = torch_dtype(options.dtype) or "auto"
    model, info = AutoModelForSequenceClassification.from_pretrained(options.path, num_labels=1, dtype=dtype,
                                                                     output_loading_info=True)  # fmt: skip
    if info["missing_keys"]:
        missing = ", ".join(sorted(info["missing_keys"])[:3])
        raise ConfigError(f"{key}.path={options.path} lacks weights a sequence classifier needs ({missing}): {FIX}")
    model.config.pad_token_id = tokenizer.pad_token_id  # the classifier reads the last token that is not padding
    return Classifier(model.to(device).eval(), tokenizer, options.batch_size, chat_template_kwargs)


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
