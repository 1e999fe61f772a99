"""The Hugging Face Hub as a source of models and datasets: whether a value is a Hub id, whether this machine has it
(a local path, the Hugging Face cache) or can fetch it, decided before anything reaches for the network. Which of a
run's values are Hub ids is hub_sources.py's.

Without a network the libraries find out slowly and loudly: each file a model or dataset load asks for is retried
five times with back-off (about 25 s, every retry printed), then the load fails with a traceback. So the run asks
once per process: HF_HUB_OFFLINE=1 answers at once, else one short probe of the configured endpoint; when the Hub
does not answer, offline mode is switched on for this process and those it starts, and the cache serves.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

PROBE_TIMEOUT_S = 3.0
OFFLINE_BY_ENV = "HF_HUB_OFFLINE=1"


@dataclass(frozen=True)
class HubSource:
    """A config value the run reads from the Hub."""

    key: str
    repo_id: str
    repo_type: str
    """"model" or "dataset"."""
    revision: str | None = None
    marker: str = "config.json"
    """The file of a model repository whose cached copy says the cache holds it: a tokenizer's repository may have no
    config.json (tokenizer_config.json then)."""

    def cached(self) -> bool:
        """Whether the Hugging Face cache holds it: a model's ``marker`` file, or a dataset as ``datasets`` caches what
        it loaded (the only copy its offline mode reads)."""
        from huggingface_hub import constants, try_to_load_from_cache

        if self.repo_type == "model":
            return isinstance(try_to_load_from_cache(self.repo_id, self.marker, revision=self.revision), str)
        cache = Path(os.environ.get("HF_DATASETS_CACHE", Path(constants.HF_HOME) / "datasets"))
        return (cache.expanduser() / self.repo_id.replace("/", "___")).is_dir()

    def fix(self) -> str:
        """What gets it here: a local copy, or the network (for a model, once: then the cache serves)."""
        if self.repo_type == "model":
            return (
                "give a local model directory, or run where the Hub answers (or fill the cache there: "
                f"hf download {self.repo_id})"
            )
        return "give a local data file or directory, or run where the Hub answers (datasets then keeps it cached)"


def is_hub_id(value: str) -> bool:
    """Whether ``value`` can only mean a Hub repository: nothing by that name on disk, and a valid repository id
    (``owner/name`` or ``name``; an absolute, relative or home path, or one with two slashes, is not)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if Path(value).expanduser().exists():
        return False
    try:
        validate_repo_id(value)
    except HFValidationError:
        return False
    return True


@functools.cache
def unreachable() -> str | None:
    """Why this process cannot download from the Hub (HF_HUB_OFFLINE is set, or one probe of the endpoint got no
    answer within PROBE_TIMEOUT_S, or a server error); None when it can. A failed probe turns offline mode on
    (go_offline), so the cache answers at once instead of after the retries."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    if constants.HF_HUB_OFFLINE:
        return OFFLINE_BY_ENV
    try:
        status = get_session().head(constants.ENDPOINT, timeout=PROBE_TIMEOUT_S).status_code
    except Exception as error:  # noqa: BLE001 - httpx's transport errors, whatever client the user configured
        go_offline()
        return f"no answer from {constants.ENDPOINT}: {type(error).__name__}"
    if status >= 500:  # what the downloads would retry
        go_offline()
        return f"{constants.ENDPOINT} answered HTTP {status}"
    return None


def go_offline() -> None:
    """HF_HUB_OFFLINE=1 for the processes this one starts, and for the libraries already imported here, which read
    it once at import (huggingface_hub, hence transformers; datasets)."""
    import sys

    from huggingface_hub import constants

    os.environ["HF_HUB_OFFLINE"] = "1"
    constants.HF_HUB_OFFLINE = True
    if "datasets.config" in sys.modules:
        sys.modules["datasets.config"].HF_HUB_OFFLINE = True
