"""The Hub ids a run reads, and refusing those this machine can neither find nor fetch: before the first load, the
launcher's check (cli.py) and the serving plan's (serving/choice.py) ask here.

Apart from hub.py because it reads the reward models' paths (rewards/reward_model.py), while rewards/classifier.py
asks hub.is_hub_id: the Hub's primitives sit below the components, this list of sources above them.
"""

from __future__ import annotations

from asyncrl.config.errors import ConfigError
from asyncrl.config.schema import Config
from asyncrl.hub import OFFLINE_BY_ENV, HubSource, is_hub_id, unreachable
from asyncrl.rewards.reward_model import reward_model_options


def hub_sources(config: Config) -> list[HubSource]:
    """The Hub ids the run reads: the model (and its tokenizer), the reward models (at their revision) and their
    tokenizers, the training and evaluation data."""
    found = []
    if is_hub_id(config.model.name_or_path):
        found.append(HubSource("model.name_or_path", config.model.name_or_path, "model", config.model.revision))
    for key, options in reward_model_options(config):
        if is_hub_id(options.path):
            found.append(HubSource(f"{key}.path", options.path, "model", options.revision))
        if options.tokenizer is not None and is_hub_id(options.tokenizer):  # read at its default branch
            found.append(HubSource(f"{key}.tokenizer", options.tokenizer, "model", marker="tokenizer_config.json"))
    evaluates = config.data.num_eval_prompts > 0
    for key, path in (
        ("data.path", config.data.path),
        ("data.eval_path", config.data.eval_path if evaluates else None),
    ):
        if path is not None and is_hub_id(path):
            found.append(HubSource(key, path, "dataset"))
    return found


def unreachable_for(config: Config) -> str | None:
    """unreachable(), asked (and the endpoint probed) only when the run reads something from the Hub."""
    return unreachable() if hub_sources(config) else None


def check_hub_sources(config: Config) -> str | None:
    """Refuse a Hub id that is neither on disk nor in the cache when the Hub cannot be reached, in one line naming
    the key and the fixes: before the first load, which would otherwise wait through the retries. Returns a note
    when the probe turned offline mode on and the cache has everything."""
    why = unreachable_for(config)
    if why is None:
        return None
    sources = hub_sources(config)
    for source in sources:
        if not source.cached():
            raise ConfigError(
                f"{source.key}={source.repo_id}: not on this machine (no such path, not in the Hugging Face cache) "
                f"and the Hub cannot be reached ({why}): {source.fix()}"
            )
    if why == OFFLINE_BY_ENV:
        return None
    cached = ", ".join(source.repo_id for source in sources)
    return f"the Hub cannot be reached ({why}): {cached} from the Hugging Face cache (HF_HUB_OFFLINE=1 from here on)"
