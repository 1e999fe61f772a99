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
        dataset = _load_file(source, builder, key)
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


def _load_file(source: Path, builder: str, key: str) -> Dataset:
    """A json/jsonl/parquet file; an empty one, or a JSON Lines row that does not parse, named with its line."""
    if source.stat().st_size == 0:
        raise DatasetError(f"{key}={source}: the file is empty; give a data file with a 'prompt' column")
    if source.suffix == ".jsonl":
        _check_json_lines(source, key)
    try:
        return load_dataset(builder, data_files=str(source), split="train")
    except Exception as exc:  # noqa: BLE001 - datasets/pyarrow raise many types for one unreadable file
        raise DatasetError(f"{key}={source}: cannot be read as {source.suffix[1:]} ({type(exc).__name__}: "
                           f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''})") from exc  # fmt: skip


def _check_json_lines(source: Path, key: str) -> None:
    """Each non-blank line is one JSON object (pyarrow's parse error names a byte offset, not the line)."""
    import json

    with source.open(encoding="utf-8", errors="replace") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line.rstrip("\n"))
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{source}:{number}: not valid JSON ({exc.msg} at column {exc.colno}); fix "
                                   f"or remove that line ({key})") from exc  # fmt: skip
            if not isinstance(row, dict):
                raise DatasetError(f"{source}:{number}: a JSON Lines row must be an object, found "
                                   f"{type(row).__name__}; fix or remove that line ({key})")  # fmt: skip


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
