"""One line for each configuration error, naming the key and what it accepts.

Hydra and OmegaConf report a bad override over several lines (the key, ``reference_type``, ``object_type``) or
only as a wrapper ("Error merging override ...") whose cause holds the reason; a misspelt key does not say which
keys exist. ``config_error_line`` turns any of them into one line; ``check_run_dir`` finds a run directory that
cannot be created before Hydra tries (and fails with a traceback).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from asyncrl.config.errors import ConfigError

MOVED_KEYS = {"packing.attention": "trainer.attention", "packing.compile_layers": "trainer.compile_layers"}
"""Keys that were renamed: the old spelling fails naming the new one."""


def moved_key(full_key: str) -> str:
    """`` (moved: set NEW instead)`` for a renamed key, else ""."""
    new = MOVED_KEYS.get(full_key)
    return f" ({full_key} is now {new}: set {new} instead)" if new else ""


def config_error_line(exc: BaseException) -> str:
    """The error as one line; a key that is not in its settings group lists the group's real keys, a renamed one
    names its new key."""
    cause = exc if isinstance(exc, OmegaConfBaseException) else exc.__cause__
    if isinstance(cause, OmegaConfBaseException) and getattr(cause, "full_key", None) in MOVED_KEYS:
        return f"{cause.full_key}: no such key{moved_key(cause.full_key)}"
    if isinstance(cause, OmegaConfBaseException) and getattr(cause, "full_key", None):
        if isinstance(cause, ConfigKeyError | ConfigAttributeError) and dataclasses.is_dataclass(cause.object_type):
            return unknown_key(cause.full_key, cause.object_type)
        return f"{cause.full_key}: {_first_line(str(cause))}"
    options = getattr(exc, "options", None)
    if options:  # Hydra's MissingConfigException for a config group option that does not exist
        return f"{_first_line(str(exc))}; options: {', '.join(options)}"
    return " ".join(line.strip() for line in str(exc).splitlines() if line.strip())


def check_known_keys(node: DictConfig, prefix: str = "") -> None:
    """Every key of a settings group is one of its fields: OmegaConf lets ``+group.key=value`` add a key to a
    structured config, and converting it to the dataclass keeps it as an attribute nothing reads."""
    group = OmegaConf.get_type(node)
    fields = {f.name for f in dataclasses.fields(group)} if dataclasses.is_dataclass(group) else None
    for key in node.keys():
        full_key = f"{prefix}{key}"
        if fields is not None and key not in fields:
            raise ConfigError(unknown_key(full_key, group))
        child = node._get_node(key)
        if isinstance(child, DictConfig) and fields is not None:
            check_known_keys(child, f"{full_key}.")


def unknown_key(full_key: str, group: type) -> str:
    parent, _, name = full_key.rpartition(".")
    keys = [f.name for f in dataclasses.fields(group)]
    close = difflib.get_close_matches(name, keys, n=1)
    hint = f" (did you mean {parent + '.' if parent else ''}{close[0]}?)" if close else ""
    where = f"settings group '{parent}'" if parent else "the config"
    return f"{full_key}: no such key{hint}; the keys of {where}: {', '.join(keys)}"


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0].strip() if text.strip() else ""


def check_run_dir(run_dir: str, key: str) -> None:
    """The run directory's nearest existing ancestor must be a writable directory."""
    path = Path(run_dir).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"{key}={run_dir}: {existing} is a file, not a directory; choose another {key}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}={run_dir}: {existing} is not writable; choose another {key}")
