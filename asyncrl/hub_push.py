"""Pushing a run's model to the Hugging Face Hub (hub.push_to_hub) with transformers' Trainer semantics: the
repository is created as the job starts, the final model goes at the end, and with hub.hub_strategy each checkpoint
too, as the trainer saves it. Every push carries a model card (README.md) holding the run's config and its held-out
evaluation. huggingface_hub's HfApi uploads. The dataset repository of logging.log_completions_hub_repo is created here
too, as the job starts; the trainer fills it (trainer/completions_hub.py).

launch.py runs a training job inside ``pushing``; the CLI calls ``check_hub_push`` and ``check_completions_hub`` before
the job loads anything.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.config.compose import to_yaml
from asyncrl.config.errors import ConfigError
from asyncrl.config.schema import Config, HubStrategy

log = logging.getLogger("asyncrl")

WATCH_INTERVAL_S = 5.0
"""How often the launcher looks for a checkpoint to push while the trainer runs."""


class HubPushError(RuntimeError):
    """The final push failed; the model is on disk, and the message says how to upload it."""


def check_hub_push(config: Config) -> None:
    """hub.push_to_hub needs a Hub that answers and a token (``check_hub_writable``)."""
    if config.hub.push_to_hub:
        check_hub_writable(
            "hub.push_to_hub=true", "set hub.push_to_hub=false and upload <output_dir>/model later (hf upload)"
        )


def check_completions_hub(config: Config) -> None:
    """logging.log_completions_hub_repo, the same: its files are kept in <run_dir>/completions either way."""
    repo = config.logging.log_completions_hub_repo
    if repo is not None:
        check_hub_writable(
            f"logging.log_completions_hub_repo={repo}",
            f"set logging.log_completions_hub_repo=null and upload <run_dir>/completions later (hf upload {repo} "
            "<run_dir>/completions --repo-type dataset)",
        )


def check_hub_writable(setting: str, instead: str) -> None:
    """``setting`` uploads to the Hub: checked before the job loads anything, the Hub answers and a token exists; the
    token's write access shows when the job creates the repository (``create_repo``)."""
    from huggingface_hub import get_token

    from asyncrl.hub import unreachable

    why = unreachable()
    if why is not None:
        raise ConfigError(f"{setting}, but the Hub cannot be reached ({why}): run where it answers, or {instead}")
    if get_token() is None:
        raise ConfigError(f"{setting} needs a Hugging Face token that may write: hf auth login, or HF_TOKEN")


def create_repo(key: str, name: str, private: bool | None, repo_type: str | None = None) -> tuple[Any, str]:
    """Create the repository ``name`` (``key``'s value; a model's unless ``repo_type``), or find it, as transformers
    does when its Trainer is built: a token that cannot write there refuses the run before it trains rather than after.
    Returns huggingface_hub's HfApi and the repository's full id (a bare name is in the token's user's namespace)."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError

    api = HfApi()
    try:
        url = api.create_repo(name, private=private, repo_type=repo_type, exist_ok=True)
    except (HfHubHTTPError, HFValidationError) as exc:
        raise ConfigError(
            f"{key}={name}: the Hub refused to create the repository ({first_line(exc)}): check that the token may "
            f"write there (hf auth whoami), or set another {key}"
        ) from exc
    return api, url.repo_id


@dataclass(frozen=True)
class HubPush:
    """One run's repository, and what goes into it."""

    config: Config
    run_dir: Path
    repo_id: str
    api: Any
    """huggingface_hub's HfApi."""

    @classmethod
    def create(cls, config: Config, run_dir: Path) -> HubPush:
        """Create the repository, or find it (``create_repo``)."""
        name = config.hub.hub_model_id or config.run_name or run_dir.name
        api, repo_id = create_repo("hub.hub_model_id", name, config.hub.hub_private_repo)
        return cls(config, run_dir, repo_id, api)

    def push_checkpoint(self, checkpoint: Path) -> None:
        """One save under hub.hub_strategy: the checkpoint's model at the repository's root (its resume-only files
        stay on disk), and under checkpoint / all_checkpoints the whole checkpoint, in last-checkpoint/ or where the run
        directory has it."""
        from asyncrl.trainer.checkpoint import SHARDED_DIR, STATE_KEYS, TORCH_STATES, checkpoint_step

        step = checkpoint_step(checkpoint)
        message = f"Training in progress, step {step}"
        self.write_card(checkpoint, f"its checkpoint at step {step}")
        self._upload(checkpoint, message, ignore_patterns=[f"{SHARDED_DIR}/*", *TORCH_STATES, *STATE_KEYS])
        strategy = self.config.hub.hub_strategy
        if strategy == HubStrategy.checkpoint:
            self._upload(checkpoint, message, path_in_repo="last-checkpoint")
        elif strategy == HubStrategy.all_checkpoints:
            self._upload(checkpoint, message, path_in_repo=f"{checkpoint.parent.name}/{checkpoint.name}")

    def push_model(self, model_dir: Path) -> None:
        """The final model at the repository's root; a failed upload says how to repeat it by hand."""
        self.write_card(model_dir, "the model at the end of training")
        try:
            self._upload(model_dir, "End of training")
        except Exception as exc:  # noqa: BLE001 - whatever the upload raised: the model is on disk, the line says so
            raise HubPushError(
                f"pushing {model_dir} to {self.repo_id} on the Hub failed ({type(exc).__name__}: {first_line(exc)}); "
                f"the model is saved there: hf upload {self.repo_id} {model_dir}"
            ) from exc

    def write_card(self, folder: Path, what: str) -> None:
        """README.md in ``folder``: the model trained and from what, the held-out evaluation when the run has one
        (eval.json) and the config, under the Hub's metadata (base model, dataset, library, tags)."""
        from huggingface_hub import ModelCard, ModelCardData

        from asyncrl.hub import is_hub_id

        c = self.config
        base, data = c.model.name_or_path, c.data.path
        metadata = ModelCardData(
            base_model=base if is_hub_id(base) else None,
            datasets=[data] if data is not None and is_hub_id(data) else None,
            library_name="peft" if c.lora.enabled else "transformers",
            tags=["asyncrl", "grpo"],
        )
        sections = [
            f"# {self.repo_id}",
            f"`{base}` trained with asyncrl's asynchronous GRPO: {what}.",
            *self._evaluation(),
            f"## Configuration\n\n```yaml\n{to_yaml(c)}```",
        ]
        ModelCard(f"---\n{metadata.to_yaml()}\n---\n\n" + "\n\n".join(sections) + "\n").save(folder / "README.md")

    def _evaluation(self) -> list[str]:
        """The held-out rewards at the run's two ends (eval.json) as a table; nothing before the run has them."""
        path = self.run_dir / "eval.json"
        if not path.is_file():
            return []
        record = json.loads(path.read_text())
        before, after = record["before"], record["after"]
        header = f"| reward | {record['before_model']} (step {record['before_step']}) | step {record['after_step']} |"
        rows = [f"| {key} | {before[key]:.3f} | {after[key]:.3f} |" for key in sorted(before.keys() & after.keys())]
        where = f"`{self.config.data.eval_path}` (its first {self.config.data.num_eval_prompts} prompts at most)"
        return ["## Held-out evaluation", f"Mean reward on {where}:\n\n" + "\n".join([header, "|---|---|---|", *rows])]

    def _upload(self, folder: Path, message: str, **options: Any) -> None:
        self.api.upload_folder(repo_id=self.repo_id, folder_path=folder, commit_message=message, **options)
        log.info("pushed %s to %s on the Hub", folder, self.repo_id)


class CheckpointWatch:
    """Pushes each checkpoint the trainer saves, from a thread of the launcher that looks every ``interval_s``: a
    checkpoint appears whole under its final name (trainer/checkpoint.py's ``publish``), and an upload never holds
    training up. Checkpoints saved during an upload go at the next look, only the newest of them unless
    hub.hub_strategy=all_checkpoints (transformers skips a save's push while another is in progress). A failed push
    is a warning: the next one, and the final model's, go on."""

    def __init__(self, push: HubPush, output_dir: Path, interval_s: float) -> None:
        from asyncrl.trainer.checkpoint import list_checkpoints

        self.push, self.output_dir, self.interval_s = push, output_dir, interval_s
        self.seen = set(list_checkpoints(output_dir))  # a resumed run's: pushed by the launch that saved them
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="asyncrl-hub-push", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """Let an upload in flight finish, then push what was saved since the last look."""
        self.stopped.set()
        self.thread.join()
        self._push_new()

    def abandon(self) -> None:
        """Look no more (the job failed or was interrupted): an upload in flight ends with the process."""
        self.stopped.set()

    def _run(self) -> None:
        while not self.stopped.wait(self.interval_s):
            self._push_new()

    def _push_new(self) -> None:
        from asyncrl.trainer.checkpoint import list_checkpoints

        new = [path for path in list_checkpoints(self.output_dir) if path not in self.seen]
        self.seen.update(new)
        every = self.push.config.hub.hub_strategy == HubStrategy.all_checkpoints
        for checkpoint in new if every else new[-1:]:
            try:
                self.push.push_checkpoint(checkpoint)
            except Exception as exc:  # noqa: BLE001 - the network, or a checkpoint pruned meanwhile: training goes on
                log.warning("pushing %s to %s on the Hub failed: %s", checkpoint.name, self.push.repo_id, exc)


@contextlib.contextmanager
def pushing(config: Config, run_dir: Path, interval_s: float = WATCH_INTERVAL_S) -> Iterator[None]:
    """Around a training job, with hub.push_to_hub: create the repository, push checkpoints as hub.hub_strategy says
    while the job runs, and the final model (<output_dir>/model) once it has ended well. With
    logging.log_completions_hub_repo its dataset repository is created first, the trainer filling it."""
    repo = config.logging.log_completions_hub_repo
    if repo is not None:
        create_repo("logging.log_completions_hub_repo", repo, config.hub.hub_private_repo, repo_type="dataset")
    if not config.hub.push_to_hub:
        yield
        return
    push = HubPush.create(config, run_dir)
    output_dir = Path(config.trainer.output_dir or run_dir)
    watch = None if config.hub.hub_strategy == HubStrategy.end else CheckpointWatch(push, output_dir, interval_s)
    try:
        yield
    except BaseException:
        if watch is not None:
            watch.abandon()
        raise
    if watch is not None:
        watch.stop()
    push.push_model(output_dir / "model")


def first_line(exc: BaseException) -> str:
    """An error's first non-empty line, for a one-line message."""
    return next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
