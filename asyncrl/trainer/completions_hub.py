"""logging.log_completions_hub_repo: each logging step's completions table as a parquet file in a Hub dataset
repository, as TRL's GRPOTrainer saves them, never holding training up.

The run keeps the dataset in <run_dir>/completions/ as the repository has it: data/step_N.parquet (the columns of the
trackers' table and ``step``) and a README.md whose card lists every column logged so far, so that
``datasets.load_dataset`` reads the files as one table even where a step lacks a reward function's ``log_extra``
column. A thread of the trainer (rank 0, which logs) commits what is new at most every ``interval_s``; a failed commit
warns once per kind of failure and its files go with the next. hub_push.py creates the repository as the job starts,
and the CLI checks the Hub and the token before.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from asyncrl.config.schema import Config
from asyncrl.rollout.scoring import table_columns
from asyncrl.trackers import first_per_prompt

log = logging.getLogger("asyncrl")

COMMIT_INTERVAL_S = 60.0
"""The least time between two commits: the Hub allows a repository 128 commits an hour (HTTP 429 past that), and
steps logged meanwhile go together in the next."""
FINAL_WAIT_S = 60.0
"""How long the end of the run waits for the last commit before saying how to upload the rest by hand."""
DATA_DIR = "data"
CARD = "README.md"


def start_completions_hub(config: Config, run_dir: Path) -> CompletionsHub | None:
    """The run's uploader with logging.log_completions_hub_repo, else None."""
    repo = config.logging.log_completions_hub_repo
    return None if repo is None else CompletionsHub(config, run_dir, repo)


class CompletionsHub:
    """The run's completions dataset: written by the trainer at each logging step, committed from a thread."""

    def __init__(self, config: Config, run_dir: Path, repo: str, interval_s: float = COMMIT_INTERVAL_S) -> None:
        from huggingface_hub import HfApi

        self.config, self.folder, self.repo, self.interval_s = config, run_dir / "completions", repo, interval_s
        self.repo_id: str | None = None
        """The repository's full id, once the thread has found it (a bare name is in the token's user's namespace)."""
        self.api, self.lock, self.closing = HfApi(), threading.Lock(), threading.Event()
        self.failures: set[str] = set()
        kept = sorted((self.folder / DATA_DIR).glob("*.parquet"))  # a resumed run's, whether or not they went up
        self.schema = {field.name: field.type for path in kept for field in pq.read_schema(path)}
        self.pending = kept
        if kept:
            self._write_card()  # the one a commit sends, whichever columns this launch logs
        self.thread = threading.Thread(target=self._run, name="asyncrl-completions-hub", daemon=True)
        self.thread.start()

    def write(self, step: int, records: list[dict[str, Any]]) -> None:
        """The step's table (the trackers': logging.log_unique_prompts keeps each prompt's first completion) as
        data/step_N.parquet, and the card updated; the thread commits them."""
        if self.config.logging.log_unique_prompts:
            records = first_per_prompt(records)
        table = completions_table(step, records)
        path = self.folder / DATA_DIR / f"step_{step:06d}.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, tmp := path.with_suffix(".tmp"))
        tmp.replace(path)  # whole, for a commit reading it
        if self._grow_schema(table.schema):
            self._write_card()
        with self.lock:
            self.pending.append(path)

    def close(self, timeout_s: float = FINAL_WAIT_S) -> None:
        """Commit what is left, waiting at most ``timeout_s``; what did not go up is on disk, and a warning says how to
        upload it."""
        self.closing.set()
        self.thread.join(timeout_s)
        with self.lock:
            left = len(self.pending)
        if left:
            repo = self.repo_id or self.repo
            log.warning("%d logging step(s) of completions did not reach %s on the Hub; they are in %s: hf upload %s "
                        "%s --repo-type dataset", left, repo, self.folder, repo, self.folder)  # fmt: skip

    def _run(self) -> None:
        while not self.closing.wait(self.interval_s):
            self._commit()
        self._commit()

    def _commit(self) -> None:
        """One commit of the files logged since the last that went up, with the card; a failure leaves them for the
        next."""
        with self.lock:
            paths = list(self.pending)
        if not paths:
            return
        try:
            self._upload(paths)
        except Exception as exc:  # noqa: BLE001 - whatever the Hub or the network raised: training goes on
            self._warn_once(exc)
            return
        with self.lock:
            del self.pending[: len(paths)]  # write() only appends

    def _upload(self, paths: list[Path]) -> None:
        from huggingface_hub import CommitOperationAdd

        if self.repo_id is None:
            url = self.api.create_repo(self.repo, repo_type="dataset", private=self.config.hub.hub_private_repo,
                                       exist_ok=True)  # fmt: skip
            self.repo_id = url.repo_id
        files = [*dict.fromkeys(paths), self.folder / CARD]  # a resumed step written again goes once
        operations = [CommitOperationAdd(path.relative_to(self.folder).as_posix(), path) for path in files]
        self.api.create_commit(self.repo_id, operations, commit_message=f"Completions up to {paths[-1].stem}",
                               repo_type="dataset")  # fmt: skip
        log.info("pushed %d logging step(s) of completions to %s", len(paths), self.repo_id)

    def _warn_once(self, exc: Exception) -> None:
        """One warning per kind of failure (an HTTP status, an error type), not one per commit of a long outage."""
        status = getattr(getattr(exc, "response", None), "status_code", None)
        kind = type(exc).__name__ if status is None else f"HTTP {status}"
        if kind in self.failures:
            return
        self.failures.add(kind)
        log.warning(
            "committing completions to %s on the Hub failed (%s: %s); training goes on, and the files wait in %s for "
            "the next commit", self.repo_id or self.repo, kind, " ".join(str(exc).split()), self.folder,
        )  # fmt: skip

    def _grow_schema(self, schema: pa.Schema) -> bool:
        """Add the columns, and the types of columns so far all null, that ``schema`` brings; whether it brought any."""
        grown = False
        for field in schema:
            known = self.schema.get(field.name)
            if known is None or (pa.types.is_null(known) and not pa.types.is_null(field.type)):
                self.schema[field.name], grown = field.type, True
        return grown

    def _write_card(self) -> None:
        """README.md: the dataset's files and every column logged so far (``datasets`` casts each file to them,
        filling the columns it lacks with nulls)."""
        from datasets import DatasetInfo, Features
        from datasets.info import DatasetInfosDict
        from huggingface_hub import DatasetCard, DatasetCardData

        from asyncrl.hub import is_hub_id

        data = DatasetCardData(
            configs=[{"config_name": "default", "data_files": [{"split": "train", "path": f"{DATA_DIR}/*.parquet"}]}],
            tags=["asyncrl", "grpo", "completions"],
        )
        features = Features.from_arrow_schema(pa.schema(list(self.schema.items())))
        DatasetInfosDict({"default": DatasetInfo(features=features)}).to_dataset_card_data(data)
        base = self.config.model.name_or_path
        model = f"`{base}`" if is_hub_id(base) else "a local model"  # its path is no business of a public card
        text = (f"Completions of {model} logged by an asyncrl GRPO run: one file per logging step in {DATA_DIR}/, its "
                "step in the `step` column.")  # fmt: skip
        card = self.folder / CARD
        DatasetCard(f"---\n{data.to_yaml()}\n---\n\n{text}\n").save(tmp := card.with_suffix(".tmp"))
        tmp.replace(card)  # whole, for a commit reading it


def completions_table(step: int, records: list[dict[str, Any]]) -> pa.Table:
    """The trackers' columns (``table_columns``) after ``step``, a missing value null."""
    columns = {"step": pa.array([step] * len(records), pa.int64())}
    for column in table_columns(records):
        columns[column] = _column([record.get(column) for record in records])
    return pa.table(columns)


def _column(values: list[Any]) -> pa.Array:
    """A column as pyarrow types it, integers as float64 (a score of 0 or 1 in one step and 0.5 in the next would
    give the files two types); a column it cannot type (a number beside a text) as text."""
    try:
        array = pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return pa.array([None if value is None else str(value) for value in values], pa.string())
    return array.cast(pa.float64()) if pa.types.is_integer(array.type) else array
