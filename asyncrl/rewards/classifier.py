"""A reward model's sequence classifier: the checks on its checkpoint, made before anything loads, and the scoring,
done as TRL's GRPOTrainer does it (the reward model's own tokenizer, or the one its ``tokenizer`` option names, with
its chat template for a conversation of the prompt's and the completion's messages, or prompt + completion for plain
text; right-padded, no special tokens added; the reward is logits[:, 0]). Its checkpoint and tokenizer load with
model.trust_remote_code, as TRL applies its trust_remote_code to reward models.

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
    of labels; and for a ``tokenizer`` that is neither a directory nor a Hub id. Reads config.json only, into
    transformers' base config: a checkpoint's own code never runs here, only where it loads, if model.trust_remote_code
    allows it. A Hub id that is not in the cache yet is checked by the Hub check (asyncrl/hub.py) and as it loads."""
    from asyncrl.hub import is_hub_id

    where, local = f"{key}.path={options.path}", Path(options.path).expanduser()
    if not local.exists() and not is_hub_id(options.path):
        raise ConfigError(f"{where}: no such directory; give a sequence-classification checkpoint's directory "
                          "(save_pretrained layout) or its Hub id")  # fmt: skip
    tokenizer = options.tokenizer
    if tokenizer is not None and not Path(tokenizer).expanduser().exists() and not is_hub_id(tokenizer):
        raise ConfigError(f"{key}.tokenizer={tokenizer}: no such directory; give a tokenizer's directory or its "
                          "Hub id, or drop it to read with the checkpoint's own")  # fmt: skip
    try:
        config = read_config(options)
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


def read_config(options: RewardModelOptions) -> Any:
    """The checkpoint's config.json (on disk or in the Hub cache) as transformers' base config: its architectures and
    label count, whatever its model type, without importing or running the model's code."""
    from transformers import PretrainedConfig

    config_dict, _ = PretrainedConfig.get_config_dict(options.path, revision=options.revision, local_files_only=True)
    return PretrainedConfig.from_dict(config_dict)


def check_own_code(options: RewardModelOptions, key: str, trust_remote_code: bool) -> None:
    """A checkpoint whose model type this transformers does not know loads with its own code (config.json's
    auto_map), which transformers runs only when trusted: refused in one line naming model.trust_remote_code, the
    one switch for the policy and the reward models (TRL's)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if trust_remote_code:
        return
    try:
        config = read_config(options)
    except (OSError, ValueError):
        return  # not here yet: loading it names what is wrong
    if getattr(config, "auto_map", None) and config.model_type not in CONFIG_MAPPING:
        raise ConfigError(f"{key}.path={options.path} is a {config.model_type} checkpoint that loads with its own code "
                          "(auto_map in its config.json): set model.trust_remote_code=true to run it (it applies to "
                          "the policy and the reward models, as TRL's)")  # fmt: skip


def check_tokenizer(options: RewardModelOptions, key: str, conversational: bool, *,
                    trust_remote_code: bool = False) -> None:  # fmt: skip
    """The checkpoint loads as trusted, and its tokenizer (or the ``tokenizer`` option's) loads, with a chat template
    when the prompts are conversations."""
    check_own_code(options, key, trust_remote_code)
    tokenizer = load_tokenizer(options, key, trust_remote_code)
    if conversational and tokenizer.chat_template is None:
        raise ConfigError(f"{tokenizer_key(options, key)}: its tokenizer has no chat template to render the "
                          "conversational prompts and completions with; give a reward model whose tokenizer has one "
                          f"(or {key}.tokenizer=ONE_THAT_HAS), or plain-text prompts")  # fmt: skip


def tokenizer_key(options: RewardModelOptions, key: str) -> str:
    """Where the reward model's tokenizer comes from, as the key and value to name in an error."""
    return f"{key}.path={options.path}" if options.tokenizer is None else f"{key}.tokenizer={options.tokenizer}"


def load_tokenizer(options: RewardModelOptions, key: str, trust_remote_code: bool) -> Any:
    """The reward model's tokenizer (the ``tokenizer`` option's, else the checkpoint's own at its revision), its pad
    token the EOS where it has none (TRL's)."""
    from transformers import AutoTokenizer

    source = {"revision": options.revision} if options.tokenizer is None else {}
    try:
        tokenizer = AutoTokenizer.from_pretrained(options.tokenizer or options.path,
                                                  trust_remote_code=trust_remote_code, **source)  # fmt: skip
    except (OSError, ValueError) as error:
        raise ConfigError(f"{tokenizer_key(options, key)}: cannot load its tokenizer ({first_line(error)})") from error
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


def load_classifier(options: RewardModelOptions, key: str, device: torch.device, chat_template_kwargs: dict[str, Any],
                    *, trust_remote_code: bool = False) -> Classifier:  # fmt: skip
    """The checkpoint as a sequence classifier with one label on ``device``; a weight it lacks (a head that would be
    initialised at random) is refused, and so is a tokenizer with ids past its embeddings."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    source = {"revision": options.revision, "trust_remote_code": trust_remote_code}
    check_own_code(options, key, trust_remote_code)
    AutoConfig.from_pretrained(options.path, **source)  # a Hub id's config.json into the cache, for the check below
    check_checkpoint(options, key)
    tokenizer = load_tokenizer(options, key, trust_remote_code)
    dtype = torch_dtype(options.dtype) or "auto"
    model, info = AutoModelForSequenceClassification.from_pretrained(options.path, num_labels=1, dtype=dtype,
                                                                     output_loading_info=True, **source)  # fmt: skip
    if info["missing_keys"]:
        missing = ", ".join(sorted(info["missing_keys"])[:3])
        raise ConfigError(f"{key}.path={options.path} lacks weights a sequence classifier needs ({missing}): {FIX}")
    embedded = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > embedded:
        raise ConfigError(f"{tokenizer_key(options, key)}: its tokenizer has {len(tokenizer)} tokens, more than the "
                          f"{embedded} the reward model embeds; give the tokenizer it was trained with")  # fmt: skip
    model.config.pad_token_id = tokenizer.pad_token_id  # the classifier reads the last token that is not padding
    return Classifier(model.to(device).eval(), tokenizer, options.batch_size, chat_template_kwargs)


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
