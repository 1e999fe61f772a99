"""The trainer's torch threads on the CPU: it keeps the cores the launched built-in server leaves."""

from __future__ import annotations

import pytest
import torch

from asyncrl.config import compose, to_config
from asyncrl.trainer.model import trainer_cpu_threads, use_cpu_threads


@pytest.mark.parametrize(
    ("overrides", "world", "cores", "threads"),
    [
        ([], 1, 2, 1),  # the embedded default on CI's 2 cores: one for the server, one for the trainer
        ([], 1, 16, 15),
        (["server.cpu_threads=4"], 2, 16, 6),  # the rest split over the ranks
        (["server.cpu_threads=4"], 8, 8, 1),  # at least one each
        (["server.launch=false", "server.base_url=http://10.0.0.2:8000"], 1, 16, 16),  # a server elsewhere
        (["server.backend=vllm"], 1, 16, 16),  # vLLM runs on a GPU
        (["server.device=cuda"], 1, 16, 16),
        (["trainer.cpu_threads=3"], 1, 16, 3),  # set: taken as is
    ],
)
def test_the_trainer_takes_the_cores_the_server_leaves(overrides, world, cores, threads):
    assert trainer_cpu_threads(to_config(compose(overrides)), world, cores) == threads


def test_the_threads_are_set_on_a_cpu_machine():
    before = torch.get_num_threads()
    try:
        use_cpu_threads(to_config(compose(["trainer.cpu_threads=1"])), world=1)
        assert torch.get_num_threads() == (before if torch.cuda.is_available() else 1)
    finally:
        torch.set_num_threads(before)
