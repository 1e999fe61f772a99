"""Prompt datasets: a hub id, a local directory, or a json/jsonl/parquet file, with a conversational `prompt`.

Checked before anything starts: a missing `prompt` column or non-conversational prompts fail with a message
saying what was found.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from datasets import Dataset, load_dataset, load_from_disk

_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}


class DatasetError(ValueError):
    """The dataset cannot be trained on; the message names the source and what was found."""


def load_prompts(path: str, *, name: str | None = None, split: str = "train", key: str = "data.path") -> Dataset:
    """``key`` is the config key that named ``path``, for the error when nothing is found there."""
    source = Path(path)
    if source.suffix in _FILE_BUILDERS and not source.exists():
        raise DatasetError(f"{key}={path}: no such file")
    if source.is_file():
        builder = _FILE_BUILDERS.get(source.suffix)
        if builder is None:
            raise DatasetError(
                f"data file {path}: unsupported extension {source.suffix!r} (use .json, .jsonl, .parquet)"
            )
        dataset = load_dataset(builder, data_files=str(source), split="train")
    elif source.is_dir() and any((source / f).exists() for f in ("dataset_dict.json", "state.json")):
        loaded = load_from_disk(str(source))
        dataset = loaded[split] if hasattr(loaded, "keys") else loaded
    else:
        try:
            dataset = load_dataset(path, name, split=split)
        except (FileNotFoundError, ConnectionError) as exc:  # not a directory, file or reachable hub dataset
            raise DatasetError(f"{key}={path}: {exc}") from exc
    check_prompts(dataset, path)
    return dataset


def check_prompts(dataset: Dataset, source: str) -> None:
    if "prompt" not in dataset.column_names:
        raise DatasetError(
            f"dataset {source} has no 'prompt' column (columns: {', '.join(dataset.column_names)}); asyncrl needs "
            "conversational prompts: a list of {'role', 'content'} messages per row"
        )
    if len(dataset) == 0:
        raise DatasetError(f"dataset {source} is empty")
    first = dataset[0]["prompt"]
    if not _is_conversation(first):
        raise DatasetError(
            f"dataset {source}: 'prompt' must be a list of {{'role', 'content'}} messages, found "
            f"{type(first).__name__}: {str(first)[:80]!r}"
        )


def _is_conversation(value: Any) -> bool:
    return (
        isinstance(value, list)
        and len(value) > 0
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)
    )
