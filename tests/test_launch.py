"""The launcher's checks before anything starts: a new run never trains into a directory that holds another, and
every server it launches has a free port."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from asyncrl.config import ConfigError
from asyncrl.config.compose import compose, to_config
from asyncrl.launch import _check_resume, check_port, serve_overrides
from asyncrl.server.process import free_port, port_is_free
from asyncrl.trainer.checkpoint import ResumeError


def _config(run_dir: Path):  # type: ignore[no-untyped-def]
    return to_config(compose([f"trainer.output_dir={run_dir}"]))


@pytest.mark.parametrize("earlier", ["metrics.jsonl", "model/config.json", "checkpoints/step_000002/x"])
def test_a_new_run_refuses_a_directory_an_earlier_run_trained_in(tmp_path, earlier):
    (tmp_path / earlier).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / earlier).write_text("{}")
    with pytest.raises(ResumeError, match=r"trainer.resume_from_checkpoint=latest, or train into a new directory"):
        _check_resume(_config(tmp_path), tmp_path)


def test_a_directory_without_training_history_is_fine(tmp_path):
    (tmp_path / ".hydra").mkdir()  # Hydra writes these before the job: they are no history
    (tmp_path / "config.yaml").write_text("{}")  # a run that failed before its first step
    _check_resume(_config(tmp_path), tmp_path)


def test_each_replica_needs_its_port_free():
    port = free_port()
    while not port_is_free("127.0.0.1", port + 1):
        port = free_port()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port + 1))
        busy.listen()
        check_port(to_config(compose([f"server.port={port}"])))  # one server: port + 1 is not its business
        with pytest.raises(ConfigError, match=rf"^server.port={port} \+ replica 1: 127.0.0.1:{port + 1} is already"):
            check_port(to_config(compose([f"server.port={port}", "server.replicas=2"])))


def _model_files(directory: Path) -> Path:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text("{}")
    (directory / "model.safetensors").write_text("")
    return directory


def test_serve_takes_a_run_directory_with_its_overrides_then_the_given_ones(tmp_path):
    run = tmp_path / "run"
    checkpoint = _model_files(run / "checkpoints" / "step_000004")
    (run / ".hydra").mkdir()
    recorded = ["+recipe=deepmath", "hydra.run.dir=x", "trainer.resume_from_checkpoint=latest", "server.port=9"]
    (run / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in recorded))
    assert serve_overrides([str(run), "server.port=8001"]) == [
        "+recipe=deepmath", "server.port=9", "server.port=8001", f"model.name_or_path={checkpoint}"
    ]  # fmt: skip
    final = _model_files(run / "model")  # the final model comes before any checkpoint
    assert serve_overrides([str(run)])[-1] == f"model.name_or_path={final}"
    assert serve_overrides(["server.port=8001"]) == ["server.port=8001"]  # no directory: overrides only
    with pytest.raises(ConfigError, match=rf"^asyncrl serve {tmp_path}/nowhere: {tmp_path}/nowhere: no such dir"):
        serve_overrides([str(tmp_path / "nowhere")])
