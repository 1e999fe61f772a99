"""The trainer's measured footprint is kept per shape: a change that moves it (row size, logit chunks, a reward model
on the trainer's GPU) asks for a new measurement, anything else shares the figure; the margin is 30%, at least
2 GiB."""

from __future__ import annotations

from asyncrl.config.compose import compose, to_config
from asyncrl.footprint import GIB, TrainerMemory, cached_memory, record_memory


def test_a_measured_figure_is_kept_per_shape(tmp_path, monkeypatch):
    monkeypatch.setenv("ASYNCRL_CACHE_DIR", str(tmp_path))
    config = to_config(compose([]))
    memory = TrainerMemory(10 * GIB, GIB, 80 * GIB)
    assert cached_memory(config, 512) is None
    record_memory(config, 512, memory)
    assert cached_memory(config, 512) == memory
    assert cached_memory(config, 1024) is None  # another row size
    assert cached_memory(to_config(compose(["trainer.logit_chunk_tokens=7"])), 512) is None
    assert cached_memory(to_config(compose(["model.freeze_vision_tower=false"])), 512) is None  # a tower's state
    assert cached_memory(to_config(compose(["trainer.learning_rate=1e-3"])), 512) == memory  # not a shape change
    assert cached_memory(to_config(compose(["trainer.optim_args='amsgrad=true'"])), 512) is None  # a third state tensor
    assert cached_memory(to_config(compose(["trainer.optimizer_factory=my.optim:build"])), 512) is None  # its own state
    assert cached_memory(to_config(compose(["reward_funcs=[{name: length, scale: 2.0}]"])), 512) == memory
    with_a_reward_model = ["reward_funcs=[{name: reward_model, path: org/rm}]"]  # loaded on the trainer's GPU
    assert cached_memory(to_config(compose(with_a_reward_model)), 512) is None
    assert memory.need_bytes == 11 * GIB + int(11 * GIB * 0.3)  # a margin of 30% of the footprint, at least 2 GiB
    assert TrainerMemory(2 * GIB, GIB, 80 * GIB).need_bytes == 5 * GIB


def test_a_held_room_is_the_figure_whose_need_is_the_room():
    """Both sides of the margin's floor: the footprint plus its margin comes back to the room, never over it (but for
    the integer rounding of the margin, a byte or two under)."""
    for need in (5 * GIB, 55 * GIB + 12345):
        room = TrainerMemory.with_need(need, GIB, 80 * GIB)
        assert room.held and need - 2 <= room.need_bytes <= need and room.context_bytes == GIB
    assert not TrainerMemory(GIB, GIB, 80 * GIB).held  # a measurement
