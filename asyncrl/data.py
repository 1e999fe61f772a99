"""Prompt datasets: a hub id, a local directory, or a json/jsonl/parquet file, with a `prompt` column.

A prompt is conversational (a list of {role, content} messages: the chat template renders it) or standard, as TRL's
GRPO page allows (plain text, tokenized as it is: no chat template; its completions are plain text too).
Checked before anything starts: a missing `prompt` column or prompts of neither form fail with a message saying what
was found, and so does a row with media asyncrl does not train on: a video, an image a server would have to fetch
(an ``image_url`` part), or images beside a plain-text prompt. A conversation's images come in an ``image`` /
``images`` column (TRL's vision-language datasets) or as its image parts (rollout/images.py places them).
With data.streaming the split is a ``PromptStream``: its first rows are checked so at load, each row as the worker
reads it.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import pyarrow as pa
import pyarrow.compute as pc
from datasets import Dataset, IterableDataset, Value, load_dataset, load_from_disk

if TYPE_CHECKING:
    from asyncrl.config.schema import Config

_FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}
IMAGE_COLUMNS = ("images", "image")
"""The columns that carry a row's images in TRL's vision-language datasets."""
_MEDIA_KEYS = ("image", "image_url", "video")
"""Keys of a content part without a ``type`` that make it an image or a video."""
_TRAINED_PARTS = ("text", "image")
"""Content part types asyncrl trains on (an image part's image in it, or from the row's image column)."""
HEAD_ROWS = 100
"""A streamed split's first rows, read at load: its columns and prompt form are checked on them."""
T = TypeVar("T")


class DatasetError(ValueError):
    """The dataset cannot be trained on; the message names the source and what was found."""


def load_prompts(path: str, *, name: str | None = None, split: str = "train", key: str = "data.path") -> Dataset:
    """``key`` is the config key that named ``path``, for the error when nothing is found there."""
    dataset = open_split(path, name, split, key, streaming=False)
    check_prompts(dataset, path)
    return dataset


def open_split(path: str, name: str | None, split: str, key: str, *, streaming: bool) -> Dataset | IterableDataset:
    """The split a file, a saved directory or a Hub id holds; ``streaming``: an IterableDataset that reads rows only as
    they are asked for (a saved directory's memory-mapped Arrow files through ``to_iterable_dataset``)."""
    source = Path(path)
    if source.suffix in _FILE_BUILDERS and not source.exists():
        raise DatasetError(f"{key}={path}: no such file")
    if source.is_file():
        builder = _FILE_BUILDERS.get(source.suffix)
        if builder is None:
            raise DatasetError(
                f"data file {path}: unsupported extension {source.suffix!r} (use .json, .jsonl, .parquet)"
            )
        return _load_file(source, builder, key, streaming)
    if source.is_dir() and any((source / f).exists() for f in ("dataset_dict.json", "state.json")):
        loaded = load_from_disk(str(source))
        dataset = loaded[split] if hasattr(loaded, "keys") else loaded
        return dataset.to_iterable_dataset() if streaming else dataset
    try:
        return load_dataset(path, name, split=split, streaming=streaming)
    except (FileNotFoundError, ConnectionError) as exc:  # not a directory, file or reachable hub dataset
        raise DatasetError(f"{key}={path}: {exc}") from exc


def _load_file(source: Path, builder: str, key: str, streaming: bool = False) -> Dataset | IterableDataset:
    """A json/jsonl/parquet file; an empty one, or a JSON Lines row that does not parse, named with its line. Streamed,
    its rows are parsed as they are read: checking every line first would read the whole file."""
    if source.stat().st_size == 0:
        raise DatasetError(f"{key}={source}: the file is empty; give a data file with a 'prompt' column")
    if source.suffix == ".jsonl" and not streaming:
        _check_json_lines(source, key)
    try:
        return load_dataset(builder, data_files=str(source), split="train", streaming=streaming)
    except Exception as exc:  # noqa: BLE001 - datasets/pyarrow raise many types for one unreadable file
        raise DatasetError(unreadable(f"{key}={source}", f"as {source.suffix[1:]} ", exc)) from exc


def unreadable(what: str, how: str, exc: Exception) -> str:
    """The one-line error for data that datasets or pyarrow could not read: ``what`` cannot be read ``how``."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{what}: cannot be read {how}({type(exc).__name__}: {first})"


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


def load_train_prompts(config: Config) -> Dataset | PromptStream:
    """data.path's split: whole, or with data.streaming a ``PromptStream`` (its first HEAD_ROWS rows checked here)."""
    d = config.data
    if not d.streaming:
        return load_prompts(d.path, name=d.name, split=d.split)
    rows = open_split(d.path, d.name, d.split, "data.path", streaming=True)
    seed = config.trainer.seed if d.shuffle else None
    return PromptStream(rows, d.path, first_rows(rows, HEAD_ROWS, d.path), seed, d.shuffle_buffer_size)


def load_eval_prompts(config: Config) -> Dataset | None:
    """data.eval_path's split (None: no evaluation); with data.streaming only its first data.num_eval_prompts rows,
    the ones evaluated, are read: an eval split as big as the training one (or that one) costs no more."""
    d = config.data
    if not d.eval_path or d.num_eval_prompts <= 0:
        return None
    if not d.streaming:
        return load_prompts(d.eval_path, name=d.name, split=d.eval_split, key="data.eval_path")
    rows = open_split(d.eval_path, d.name, d.eval_split, "data.eval_path", streaming=True)
    return first_rows(rows, d.num_eval_prompts, d.eval_path)


def first_rows(rows: IterableDataset, count: int, source: str) -> Dataset:
    """A stream's first ``count`` rows as a Dataset, checked as a whole split is (``check_prompts``)."""
    try:
        head = list(itertools.islice(rows, count))
    except Exception as exc:  # noqa: BLE001 - datasets/pyarrow raise many types for one unreadable row
        raise DatasetError(unreadable(f"dataset {source}", "", exc)) from exc
    if not head:
        raise DatasetError(f"dataset {source} is empty")
    dataset = Dataset.from_list(head, features=rows.features)
    check_prompts(dataset, source)
    return dataset


@dataclass
class PromptStream:
    """A split read as a stream (data.streaming): datasets' IterableDataset, whose rows the rollout worker reads as it
    needs them, never the whole split. Its length is unknown until a pass ends (so the run stops at
    trainer.max_steps); each pass is reshuffled in a buffer (datasets' ``set_epoch``: seed + pass) and a resume reads
    and drops the rows consumed before it, as the stream cannot seek. Pickled into the worker, which reads it."""

    rows: IterableDataset
    source: str
    head: Dataset
    """The first rows, checked at load: the columns and the prompt form (``standard_prompts`` reads them)."""
    seed: int | None = None
    """None: unshuffled, the split's own order (the rows of the same split loaded whole, in the same order)."""
    buffer_size: int = 1000
    rows_per_pass: int | None = None
    """Known once a pass has been read to its end (in the process that reads it)."""

    @property
    def column_names(self) -> list[str]:
        return self.head.column_names

    def __getitem__(self, column: str) -> Any:
        """A column is never read whole: only the longest prompt, sizing vLLM's context, would ask it."""
        raise DatasetError(
            f"dataset {self.source} is streamed (data.streaming=true): its '{column}' column cannot be read whole, as "
            "measuring the longest prompt for vLLM's context would; set data.max_prompt_length or server.max_model_len"
        )

    def prompts_from(self, start: int) -> Iterator[tuple[int, int, dict[str, Any], int, bool]]:
        """(index, position in its pass, row, pass, whether it ends its pass) of each prompt from the ``start``-th
        on, pass after pass without end. The rows before ``start`` are read and dropped, whole passes skipped
        unread once a pass's length is known."""
        index = 0
        for epoch in itertools.count():
            if self.rows_per_pass is not None and start - index >= self.rows_per_pass:
                index += self.rows_per_pass
                continue
            position = -1
            for position, (row, last) in enumerate(with_last(self.pass_rows(epoch))):
                if index >= start:
                    check_streamed_row(row, position, epoch, self.source)
                    yield index, position, row, epoch, last
                index += 1
            if position < 0:
                raise DatasetError(f"dataset {self.source} is empty")
            self.rows_per_pass = position + 1

    def pass_rows(self, epoch: int) -> IterableDataset:
        """Pass ``epoch``'s rows: the split's order, or shuffled in the buffer, the same again on resume."""
        if self.seed is None:
            return self.rows
        shuffled = self.rows.shuffle(seed=self.seed, buffer_size=self.buffer_size)
        shuffled.set_epoch(epoch)
        return shuffled


def epoch_rows(dataset: Dataset | PromptStream | Sequence[dict[str, Any]]) -> int | None:
    """Rows per epoch: the dataset's length, a stream's once this process has read a pass to its end, else None."""
    return dataset.rows_per_pass if isinstance(dataset, PromptStream) else len(dataset)


def with_last(items: Iterable[T]) -> Iterator[tuple[T, bool]]:
    """Each item and whether it is the last: a stream's end shows only when the next read finds nothing."""
    iterator = iter(items)
    for current in iterator:
        for following in iterator:
            yield current, False
            current = following
        yield current, True


def check_streamed_row(row: dict[str, Any], position: int, epoch: int, source: str) -> None:
    """What ``check_prompts`` asks of a whole split, asked of one streamed row as the worker reads it."""
    prompt = row.get("prompt")
    where = f"dataset {source}: the row at position {position} of pass {epoch}"
    if not (isinstance(prompt, str) or _is_conversation(prompt)):
        raise DatasetError(f"{where} has a 'prompt' that is neither a string nor a list of {{'role', 'content'}} "
                           f"messages: {str(prompt)[:80]!r}")  # fmt: skip
    if isinstance(prompt, str) and any(row.get(c) for c in IMAGE_COLUMNS):
        raise DatasetError(f"{where} has images and a plain-text prompt: {PLAIN_WITH_IMAGES}")
    media = [] if isinstance(prompt, str) else [kind for m in prompt if (kind := _untrained_part(m["content"]))]
    if media:
        raise DatasetError(f"{where} has a {media[0]!r} content part: {UNTRAINED_FIX}")


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
    check_media(dataset, source)


def standard_prompts(rows: Dataset | PromptStream | Sequence[dict[str, Any]]) -> bool:
    """Whether the prompts are plain text (a string column: every row is one) rather than conversations; a stream's
    checked first rows say it."""
    rows = rows.head if isinstance(rows, PromptStream) else rows
    return len(rows) > 0 and isinstance(rows[0]["prompt"], str)


PLAIN_WITH_IMAGES = "give the prompt as a conversation ([{'role': 'user', 'content': ...}]) for its images"
UNTRAINED_FIX = ("asyncrl trains on text and images: give images in an 'image'/'images' column or as image parts "
                 "(no video, no image URL to fetch)")  # fmt: skip


def check_media(dataset: Dataset, source: str) -> None:
    """Refuse the first row with media asyncrl does not train on: images (a value in an ``images``/``image``
    column, read through Arrow, no image decoded) beside plain-text prompts, or a content part other than text and
    image in a prompt. The prompts are scanned only when their ``content`` is not plain strings (the dataset's
    features say so up front), so a text dataset costs nothing."""
    if _is_text(dataset.features["prompt"]):
        for column in (c for c in IMAGE_COLUMNS if c in dataset.column_names):
            row = _first_present(dataset.with_format("arrow")[column])
            if row is not None:
                raise DatasetError(f"dataset {source}: row {row} has images in its '{column}' column and a "
                                   f"plain-text prompt: {PLAIN_WITH_IMAGES}")  # fmt: skip
        return
    if _plain_text_content(dataset.features["prompt"]):
        return
    for row, messages in enumerate(dataset["prompt"]):
        for message in messages:
            kind = _untrained_part(message["content"])
            if kind is not None:
                raise DatasetError(f"dataset {source}: row {row}'s prompt has a {kind!r} content part: {UNTRAINED_FIX}")


def most_images(dataset: Dataset) -> int:
    """The most images one row's prompt has (an ``images`` list, an ``image``, or image parts): vLLM's
    --limit-mm-per-prompt. The image columns are read through Arrow (no image decoded)."""
    table = dataset.with_format("arrow")
    counts = [0]
    if "images" in dataset.column_names:
        lengths = pc.list_value_length(table["images"])
        counts.append(int(pc.max(pc.fill_null(lengths, 0)).as_py() or 0))
    if "image" in dataset.column_names:
        counts.append(int(pc.any(pc.is_valid(table["image"])).as_py() or False))
    if not (_is_text(dataset.features["prompt"]) or _plain_text_content(dataset.features["prompt"])):
        counts += [sum(_media_part([part]) == "image" for m in messages for part in _content_parts(m))
                   for messages in dataset["prompt"]]  # fmt: skip
    return max(counts)


def _content_parts(message: dict[str, Any]) -> list[Any]:
    content = message["content"]
    return content if isinstance(content, list) else []


def has_images(rows: Dataset | PromptStream) -> bool:
    """Whether the prompts carry images (a stream's checked first rows say it): the run needs a vision-language
    checkpoint."""
    return most_images(rows.head if isinstance(rows, PromptStream) else rows) > 0


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


def _untrained_part(content: Any) -> str | None:
    """The type of the first content part asyncrl does not train on (a video, an image URL); None when it has none."""
    if not isinstance(content, list):
        return None
    for part in content:
        kind = _media_part([part])
        if kind is not None and kind not in _TRAINED_PARTS:
            return kind
    return None


def _is_conversation(value: Any) -> bool:
    return (
        isinstance(value, list)
        and len(value) > 0
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)
    )
