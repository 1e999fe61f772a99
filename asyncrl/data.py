"""Prompt datasets: a hub id, a local directory, or a json/jsonl/parquet file, with a `prompt` column.

A prompt is conversational (a list of {role, content} messages: the chat template renders it) or standard, as TRL's
GRPO page allows (plain text, tokenized as it is: no chat template; its completions are plain text too).
Checked before anything starts: a missing `prompt` column or prompts of neither form fail with a message saying what
was found, and so does a row that carries an image (asyncrl trains on text only, vision-language models included:
nothing would hand the image to the server or to the training forward pass).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from datasets import Dataset, Value, load_dataset, load_from_disk

_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}
IMAGE_COLUMNS = ("images", "image")
"""The columns that carry a row's images in TRL's vision-language datasets."""
_MEDIA_KEYS = ("image", "image_url", "video")
"""Keys of a content part without a ``type`` that make it an image or a video."""


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
        raise DatasetError(
            f"{key}={source}: cannot be read as {source.suffix[1:]} ({type(exc).__name__}: "
            f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''})"
        ) from exc


def _check_json_lines(source: Path, key: str) -> None:
    """Each non-blank line is one JSON object (pyarrow's parse error names a byte offset, not the line)."""
    with source.open(encoding="utf-8", errors="replace") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line.rstrip("\n"))
            except json.JSONDecodeError as exc:
                raise DatasetError(
                    f"{source}:{number}: not valid JSON ({exc.msg} at column {exc.colno}); fix "
                    f"or remove that line ({key})"
                ) from exc
            if not isinstance(row, dict):
                raise DatasetError(
                    f"{source}:{number}: a JSON Lines row must be an object, found "
                    f"{type(row).__name__}; fix or remove that line ({key})"
                )


def check_prompts(dataset: Dataset, source: str) -> None:
    if "prompt" not in dataset.column_names:
        raise DatasetError(
            f"dataset {source} has no 'prompt' column (columns: {', '.join(dataset.column_names)}); asyncrl needs "
            "a prompt per row: a list of {'role', 'content'} messages, or a plain string"
        )
    if len(dataset) == 0:
        raise DatasetError(f"dataset {source} is empty")
    first = dataset[0]["prompt"]
    if not (_is_text(dataset.features["prompt"]) or _is_conversation(first)):
        raise DatasetError(
            f"dataset {source}: 'prompt' must be a list of {{'role', 'content'}} messages (conversational) or a "
            f"string (standard), found {type(first).__name__}: {str(first)[:80]!r}"
        )
    check_text_only(dataset, source)


def standard_prompts(rows: Dataset | Sequence[dict[str, Any]]) -> bool:
    """Whether the prompts are plain text (a string column: every row is one) rather than conversations."""
    return len(rows) > 0 and isinstance(rows[0]["prompt"], str)


def check_text_only(dataset: Dataset, source: str) -> None:
    """Refuse the first row with an image: a value in an ``images``/``image`` column (read through Arrow, no image
    decoded) or a non-text content part in its prompt. The prompts are scanned only when their ``content`` is not
    plain strings (the dataset's features say so up front), so a text dataset costs nothing."""
    fix = "asyncrl trains on text only (a vision-language model too: its vision tower stays frozen)"
    for column in (c for c in IMAGE_COLUMNS if c in dataset.column_names):
        row = _first_present(dataset.with_format("arrow")[column])
        if row is not None:
            raise DatasetError(
                f"dataset {source}: row {row} carries an image in its '{column}' column: {fix}; "
                f"drop the column (dataset.remove_columns('{column}')) or those rows"
            )
    if _is_text(dataset.features["prompt"]) or _plain_text_content(dataset.features["prompt"]):
        return
    for row, messages in enumerate(dataset["prompt"]):
        for message in messages:
            kind = _media_part(message["content"])
            if kind is not None:
                raise DatasetError(
                    f"dataset {source}: row {row}'s prompt has a {kind!r} content part: {fix}; "
                    "keep only its text parts ({'type': 'text', ...}) or drop those rows"
                )


def _first_present(values: pa.Array | pa.ChunkedArray) -> int | None:
    """The index of the first non-null (and, for lists, non-empty) value."""
    present = pc.is_valid(values)
    if pa.types.is_list(values.type) or pa.types.is_large_list(values.type):
        present = pc.and_(present, pc.greater(pc.fill_null(pc.list_value_length(values), 0), 0))
    index = pc.index(present, True).as_py()
    return None if index < 0 else index


def _is_text(feature: Any) -> bool:
    """Whether a feature is a string column (standard prompts)."""
    return isinstance(feature, Value) and feature.dtype in ("string", "large_string")


def _plain_text_content(feature: Any) -> bool:
    """Whether the prompt feature's messages have string ``content`` (so no content part can be an image)."""
    message = getattr(feature, "feature", None)
    return isinstance(message, dict) and _is_text(message.get("content"))


def _media_part(content: Any) -> str | None:
    """The type of the first non-text part of a message's content (a list of parts); None when it has none."""
    if not isinstance(content, list):
        return None
    for part in content:
        if not isinstance(part, dict):
            return type(part).__name__
        kind = str(part.get("type") or next((key for key in _MEDIA_KEYS if part.get(key) is not None), "text"))
        if kind != "text":
            return kind
    return None


def _is_conversation(value: Any) -> bool:
    return (
        isinstance(value, list)
        and len(value) > 0
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)
    )
