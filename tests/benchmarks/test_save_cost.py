"""benchmarks/save_cost.py: a timed save writes the trainer's checkpoint files, by as many writers as it is given."""

from __future__ import annotations

from types import ModuleType


def test_a_save_is_timed_and_its_resume_files_come_from_the_writers_asked_for(save_cost: ModuleType, one_rank,
                                                                              tmp_path) -> None:  # fmt: skip
    model, optimizer = save_cost.trained_model("tiny")
    for threads in (1, 3):
        seconds, size, count = save_cost.seconds_per_save(model, optimizer, one_rank, tmp_path / str(threads), threads,
                                                          repeats=2)  # fmt: skip
        assert seconds > 0 and size > 0 and count == threads + 1  # a file per writer, and .metadata
        assert (tmp_path / str(threads) / "model.safetensors").is_file()
