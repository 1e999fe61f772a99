"""Pushing to the Hub against a local endpoint that records what arrives: the repository, each commit's files and
the model card, under each hub.hub_strategy; and the refusals before anything trains."""

from __future__ import annotations

import base64
import json
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from huggingface_hub import constants

from asyncrl.config import ConfigError
from asyncrl.config.compose import compose, to_config
from asyncrl.config.schema import Config
from asyncrl.hub_push import HubPushError, check_hub_push, pushing

REPO = "org/tiny-arith-grpo"
EVAL = {"before": {"eval/greedy_reward": 1.0, "eval/sampled_reward": 0.25},
        "after": {"eval/greedy_reward": 1.0, "eval/sampled_reward": 0.75},
        "before_model": "base model", "before_step": 0, "after_step": 4}  # fmt: skip
MODEL_FILES = {"config.json", "model.safetensors", "README.md"}
RESUME_FILES = {"sharded/__0_0.distcp", "optimizer.pt", "rng_state.pt", "trainer_state.json", "rollout_state.json"}


@dataclass
class Commit:
    summary: str
    files: dict[str, bytes]


@dataclass
class FakeHub:
    """The Hub's endpoints that HfApi.create_repo and upload_folder call; every file arrives inline (the preupload
    answer makes each a regular, not an LFS, upload)."""

    endpoint: str = ""
    created: list[dict[str, Any]] = field(default_factory=list)
    commits: list[Commit] = field(default_factory=list)
    refuse: bool = False
    """Answer creations and commits with 403, as the Hub does a token that may not write."""


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers["Content-Length"]))
            if hub.refuse and (self.path == "/api/repos/create" or "/commit/" in self.path):
                return self._answer({"error": "You don't have the rights to create a model under this namespace"}, 403)
            if self.path == "/api/repos/create":
                request = json.loads(body)
                hub.created.append(request)
                return self._answer({"url": f"{hub.endpoint}/{request['organization']}/{request['name']}"})
            if self.path == "/api/validate-yaml":
                return self._answer({"errors": [], "warnings": []})
            if "/preupload/" in self.path:
                files = json.loads(body)["files"]
                return self._answer({"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                               for f in files]})  # fmt: skip
            lines = [json.loads(line) for line in body.decode().splitlines()]
            files = {op["value"]["path"]: base64.b64decode(op["value"]["content"]) for op in lines[1:]}
            hub.commits.append(Commit(lines[0]["value"]["summary"], files))
            return self._answer({"commitUrl": f"{hub.endpoint}/{REPO}/commit/{'a' * 40}", "commitOid": "a" * 40})

        def _answer(self, payload: dict[str, Any], status: int = 200) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    return Handler


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    """HfApi pointed at a local endpoint, with a token and online."""
    fake = FakeHub()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(fake))
    fake.endpoint = f"http://127.0.0.1:{server.server_port}"
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    monkeypatch.setattr(constants, "ENDPOINT", fake.endpoint)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_TOKEN", "hf_test")
    yield fake
    server.shutdown()
    thread.join()


def push_config(strategy: str) -> Config:
    return to_config(compose(["hub.push_to_hub=true", f"hub.hub_model_id={REPO}", f"hub.hub_strategy={strategy}",
                              "hub.hub_private_repo=true", "model.name_or_path=Qwen/Qwen3-0.6B"]))  # fmt: skip


def write_model(directory: Path) -> None:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text("{}")
    (directory / "model.safetensors").write_bytes(b"weights")


def save_checkpoint(run_dir: Path, step: int) -> Path:
    """A checkpoint as the trainer publishes one: written beside its name, then renamed whole."""
    final = run_dir / "checkpoints" / f"step_{step:06d}"
    tmp = final.with_name(final.name + ".tmp")
    write_model(tmp)
    for name in RESUME_FILES:
        (tmp / name).parent.mkdir(exist_ok=True)
        (tmp / name).write_bytes(b"state")
    tmp.rename(final)
    return final


def wait_for(condition: Any, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the watcher pushed nothing"
        time.sleep(0.01)


def test_end_pushes_the_final_model_with_a_card_of_the_config_and_the_held_out_evaluation(hub, tmp_path):
    with pushing(push_config("end"), tmp_path, interval_s=0.01):
        save_checkpoint(tmp_path, 2)  # not pushed under end
        write_model(tmp_path / "model")
        (tmp_path / "eval.json").write_text(json.dumps(EVAL))
    assert hub.created == [{"name": "tiny-arith-grpo", "organization": "org", "visibility": "private"}]
    (commit,) = hub.commits
    assert commit.summary == "End of training" and set(commit.files) == MODEL_FILES
    card = commit.files["README.md"].decode()
    assert card.startswith("---\nbase_model: Qwen/Qwen3-0.6B\n") and "library_name: transformers" in card
    assert "| reward | base model (step 0) | step 4 |" in card and "| eval/sampled_reward | 0.250 | 0.750 |" in card
    assert "```yaml\nmodel:\n  name_or_path: Qwen/Qwen3-0.6B\n" in card and "  hub_strategy: end\n" in card


@pytest.mark.parametrize(
    ("strategy", "whole"),
    [("every_save", None), ("checkpoint", "last-checkpoint"), ("all_checkpoints", "checkpoints/step_{step:06d}")],
)
def test_each_save_pushes_its_model_and_the_strategys_checkpoints_beside_training(hub, tmp_path, strategy, whole):
    """A checkpoint from before (a resumed run's) is not pushed again; one saved while training goes at once, the
    last one as the job ends, then the final model."""
    save_checkpoint(tmp_path, 1)
    with pushing(push_config(strategy), tmp_path, interval_s=0.01):
        save_checkpoint(tmp_path, 2)
        wait_for(lambda: hub.commits)
        save_checkpoint(tmp_path, 3)
        write_model(tmp_path / "model")
    saves = [f"Training in progress, step {step}" for step in (2, 3)]
    per_save = [saves[0]] * (1 + bool(whole)) + [saves[1]] * (1 + bool(whole))
    assert [c.summary for c in hub.commits] == [*per_save, "End of training"]
    assert [set(c.files) for c in hub.commits if c.summary == saves[0]][0] == MODEL_FILES  # no resume-only files
    if whole:
        pushed = set(hub.commits[1].files)
        assert pushed == {f"{whole.format(step=2)}/{name}" for name in MODEL_FILES | RESUME_FILES}
        assert "its checkpoint at step 2" in hub.commits[1].files[f"{whole.format(step=2)}/README.md"].decode()


def test_a_token_that_may_not_write_refuses_the_run_before_it_trains(hub, tmp_path):
    hub.refuse = True
    with pytest.raises(ConfigError) as info, pushing(push_config("end"), tmp_path):
        pytest.fail("the job ran")
    assert str(info.value).startswith(f"hub.hub_model_id={REPO}: the Hub refused to create the repository (403")
    assert "\n" not in str(info.value)


def test_a_failed_save_push_warns_and_a_failed_final_push_says_how_to_upload(hub, tmp_path, caplog):
    with pytest.raises(HubPushError) as info, pushing(push_config("every_save"), tmp_path, interval_s=0.01):
        hub.refuse = True  # after the repository exists
        save_checkpoint(tmp_path, 2)
        write_model(tmp_path / "model")
    assert str(info.value).endswith(f"the model is saved there: hf upload {REPO} {tmp_path / 'model'}")
    assert [r.levelno for r in caplog.records if "pushing step_000002" in r.getMessage()] == [logging.WARNING]


def test_pushing_needs_a_hub_that_answers_and_a_token(monkeypatch):
    config = push_config("end")
    monkeypatch.setattr("asyncrl.hub.unreachable", lambda: "HF_HUB_OFFLINE=1")
    with pytest.raises(ConfigError, match=r"^hub.push_to_hub=true, but the Hub cannot be reached \(HF_HUB_OFFLINE=1\)"):
        check_hub_push(config)
    monkeypatch.setattr("asyncrl.hub.unreachable", lambda: None)
    monkeypatch.setattr("huggingface_hub.get_token", lambda: None)
    with pytest.raises(ConfigError, match=r"^hub.push_to_hub=true needs a Hugging Face token that may write"):
        check_hub_push(config)
    monkeypatch.setattr("huggingface_hub.get_token", lambda: "hf_test")
    check_hub_push(config)
    config.hub.push_to_hub = False
    monkeypatch.setattr("asyncrl.hub.unreachable", lambda: "never asked")
    check_hub_push(config)
