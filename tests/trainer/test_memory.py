"""The warm-up step throws its update away, its synthetic row fills the token budget as a step's groups do and
leaves a step's row nothing to compile, a waiting vLLM launches once the figure is measured, and the out-of-memory
line names what changes the trainer's memory."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from packing.packing_samples import make_sample  # tests/packing

from asyncrl.components import build_components
from asyncrl.config.compose import compose, to_config
from asyncrl.config.schema import Config
from asyncrl.footprint import GIB, TrainerMemory, cached_memory, record_memory
from asyncrl.losses.step import StepLoss
from asyncrl.packing.deltanet import build_recurrent_plan
from asyncrl.trainer import fsdp
from asyncrl.trainer.distributed import split_rows, train_rows, warm_up_step
from asyncrl.trainer.memory import (
    COLD_AUTOTUNE_CONTEXT_BYTES,
    SHORT_ROW_FRACTION,
    held_room,
    hold,
    out_of_memory_line,
    room_line,
    synthetic_rows,
    warm_up,
)
from asyncrl.trainer.model import build_optimizer, load_model


def test_the_warm_up_step_leaves_weights_optimizer_and_random_state_as_they_were(random_tiny_model_dir, one_rank):
    config = to_config(compose([f"model.name_or_path={random_tiny_model_dir}", "loss=clipped",
                                "trainer.learning_rate=1e-2", "trainer.weight_decay=0.1"]))  # fmt: skip
    components = build_components(config)
    model = load_model(config, str(random_tiny_model_dir))
    optimizer, _ = build_optimizer(config, model)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    row_factory, _ = components.packer.rows(64)
    rows = synthetic_rows(row_factory, 16, 48, 4, model.config.vocab_size, top_k=0)
    loss = StepLoss(components.loss, components.advantage, 16)
    work = split_rows(rows, [[0]], loss.norm(rows))[0]
    random_state = torch.random.get_rng_state()
    resumed = {"step": torch.tensor(7.0)}  # a resumed run's moments are put back as they were
    optimizer.state[next(model.parameters())] = resumed
    model.eval()  # as from_pretrained leaves it
    modes: list[bool] = []

    def step() -> None:
        modes.append(model.training)  # checkpointing and dropout run in training mode only
        warm_up_step(model, loss, work, one_rank, config)

    warm_up(step, model, optimizer)
    assert modes == [True] and not model.training
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    assert dict(optimizer.state) == {next(model.parameters()): resumed}
    assert all(p.grad is None for p in model.parameters())
    optimizer.state.clear()
    assert [group["lr"] for group in optimizer.param_groups] == [1e-2]
    assert torch.equal(torch.random.get_rng_state(), random_state)
    optimizer.zero_grad()  # the same step for real moves the weights: the warm-up did run it
    warm_up_step(model, loss, work, one_rank, config)
    optimizer.step()
    assert any(not torch.equal(p, before[name]) for name, p in model.named_parameters())


def test_the_synthetic_row_fills_the_budget_with_trained_tokens():
    config = to_config(compose(["packing=flat", "packing.token_budget=250", "loss=score_centering"]))
    row_factory, budget = build_components(config).packer.rows(100)
    row, short = synthetic_rows(row_factory, 10, 90, 2, vocab_size=50, top_k=4)
    assert budget == 250 and row.num_forwarded == 250 and row.num_trained == 90 + 90 + 40  # the last one shortened
    assert row.top_ids is not None and row.top_ids.shape == (220, 4)
    # a short row beside it (a step's last, partly filled one): in 250 // SHORT_ROW_FRACTION = 15 tokens, the
    # group's two samples of a 3-token prompt and 3 completion tokens each (flat: the prompt forwarded twice)
    assert (short.num_forwarded, short.num_trained) == (12, 6) and short.top_ids is not None


def test_the_short_row_compiles_the_graphs_short_real_rows_need():
    """Compiled with dynamic shapes, the layers carry guards decided on the row lengths they saw (Inductor: on the
    H200, rows of at least 5120 tokens after a warm-up on a full row); the short row is well under the budget and
    a whole group's prefix of one prompt, as a step's last row is."""
    config = to_config(compose(["packing=tree", "packing.token_budget=16384", "loss=score_centering"]))
    row_factory, _ = build_components(config).packer.rows(100)
    full, short = synthetic_rows(row_factory, 64, 256, 8, vocab_size=50_000, top_k=0)
    assert full.num_forwarded == 16384 and 0 < short.num_forwarded <= 16384 // SHORT_ROW_FRACTION
    assert len(short.segments) == 1 + 8  # one prompt, a whole group of branches from it
    assert short.num_trained == 8 * (1024 // 16)


def test_the_synthetic_row_is_shaped_like_a_steps_groups_sharing_their_prompt():
    """A tree row forwards each group's prompt once and branches into its completions, as a real step's rows do
    (the structure the compiled layers compile for in the warm-up)."""
    config = to_config(compose(["packing=tree", "packing.token_budget=250", "loss=score_centering"]))
    row_factory, _ = build_components(config).packer.rows(100)
    row, _ = synthetic_rows(row_factory, 10, 60, 3, vocab_size=50_000, top_k=0)  # no accidental sharing
    # group 0: its prompt's first 9 tokens once, then 3 branches of 61 (the prompt's last token predicts each
    # branch's first: one node per branch), 192 tokens; group 1: one sample cut to the 58 left
    assert row.num_forwarded == 250 and row.num_raw_tokens == 3 * (10 + 60) + 58
    assert len(row.segments) == 1 + 3 + 1  # the shared prompt, its three branches, and group 1's own path
    plan = build_recurrent_plan(row, kernel_size=4, device=torch.device("cpu"))
    roots, branches = plan.levels  # the branches' gated-DeltaNet recurrence starts from the prompt's final state
    assert roots.parents is None and branches.parents is not None and branches.parents.tolist() == [0, 0, 0]


def test_once_the_server_is_up_the_trainer_says_what_it_took_and_whether_the_margin_is_left():
    """The 2B quick start's figures (RESULTS.md, session 17): vLLM at 0.78 held 1.9 GiB over its share."""
    memory = TrainerMemory(int(26.0 * GIB), int(1.07 * GIB), int(139.8 * GIB))
    line, roomy = room_line(memory, free_bytes=int(1.77 * GIB), reserved_bytes=int(26.0 * GIB),
                            share="--gpu-memory-utilization 0.78")  # fmt: skip
    assert not roomy and line == (
        "the server holds 111.0 GiB of the GPU's 139.8 (--gpu-memory-utilization 0.78), leaving the trainer 27.8 GiB "
        "for its measured peak of 26.0 GiB and its margin of 8.1"
    )
    assert room_line(memory, int(8.2 * GIB), int(26.0 * GIB), None)[1]  # 34.2 GiB: peak and margin fit


def test_the_out_of_memory_line_names_the_measurement_the_split_and_the_keys():
    config = to_config(compose([]))
    line = out_of_memory_line(config, TrainerMemory(30 * GIB, GIB, 140 * GIB), "--gpu-memory-utilization 0.7")
    assert line.startswith("the trainer ran out of GPU memory (the trainer's measured peak 30.0 GiB + 1.0 GiB")
    assert "vLLM was given --gpu-memory-utilization 0.7" in line
    for key in ("packing.token_budget", "trainer.gradient_checkpointing", "server.gpu_memory_utilization"):
        assert key in line


def test_a_waiting_vllm_launches_after_an_eager_measuring_step_and_before_the_compiling_one(tmp_path, monkeypatch):
    """The figure vLLM's share comes from is an eager step's, recorded and handed to the launch (whose command takes
    it); the layers compile in a second step while vLLM boots, and that step's figure is the run's and the next's."""
    from asyncrl.serving.group import ServerGroup
    from asyncrl.serving.handle import DeferredServer
    from asyncrl.trainer.loop import Trainer

    monkeypatch.setenv("ASYNCRL_CACHE_DIR", str(tmp_path))
    config = to_config(compose([]))
    events: list[object] = []
    compiles: list[int] = []

    def backend(graph: torch.fx.GraphModule, inputs: object) -> object:
        compiles.append(1)
        return graph.forward

    layer = torch.compile(lambda x: x * 2, backend=backend)

    class Booting:
        """What launch(memory) returns: entering starts the server without waiting for it (LaunchedServer,
        wait=False)."""

        def __init__(self, memory: TrainerMemory | None) -> None:
            assert cached_memory(config, 512) == memory  # recorded for the next run before the launch
            self.memory = memory

        def __enter__(self) -> Booting:
            events.append(("launch", self.memory))
            return self

    eager, compiled = TrainerMemory(4 * GIB, GIB, 80 * GIB), TrainerMemory(5 * GIB, GIB, 80 * GIB)
    figures = iter([eager, compiled])

    def step(alone: bool, known: TrainerMemory | None) -> TrainerMemory:
        before = len(compiles)
        layer(torch.ones(2))
        events.append(("step", "compiled" if len(compiles) > before else "eager", alone, known))
        return next(figures)

    trainer = Trainer.__new__(Trainer)
    trainer.config, trainer.server = config, ServerGroup([DeferredServer(Booting, "http://127.0.0.1:1")], wait=False)
    trainer.started_at, trainer.startup = 0.0, {}
    assert trainer.server.waits_for_warm_up
    assert trainer._measure_eagerly_then_compile(step, 512, 0.0) == compiled
    assert trainer.startup["perf/startup_server_launched_s"] > 0  # the launch's moment, with the start-up's phases
    assert events == [("step", "eager", True, None), ("launch", eager), ("step", "compiled", False, eager)]
    assert not trainer.server.waits_for_warm_up and trainer.server.shares_trainer_gpu  # the room is said once it is up
    assert cached_memory(config, 512) == compiled  # the next run launches vLLM on the compiled step's figure


def recording_trainer(config: Config, events: list[object], measured: TrainerMemory) -> tuple[Any, Any]:
    """A trainer with a vLLM waiting for its warm-up, whose launch and warm-up step (returning ``measured``) only
    say in ``events`` when they ran and on which figure."""
    from asyncrl.serving.group import ServerGroup
    from asyncrl.serving.handle import DeferredServer
    from asyncrl.trainer.loop import Trainer

    class Booting:
        def __init__(self, memory: TrainerMemory | None) -> None:
            self.memory = memory

        def __enter__(self) -> Booting:
            events.append(("launch", self.memory))
            return self

    def step(alone: bool, known: TrainerMemory | None) -> TrainerMemory:
        events.append(("step", alone, known))
        return measured

    trainer = Trainer.__new__(Trainer)
    trainer.config, trainer.server = config, ServerGroup([DeferredServer(Booting, "http://127.0.0.1:1")], wait=False)
    return trainer, step


def early_trainer(
    config: Config, events: list[object], measured: TrainerMemory, plan_memory: TrainerMemory | None, monkeypatch: Any
) -> tuple[Any, Any, int]:
    """A recording trainer before its model loads: its plan (vLLM's context length, a restart's figure) and packer;
    CUDA said to be there (only then does a vLLM share the trainer's GPU; figures are kept per GPU name)."""
    from types import SimpleNamespace

    trainer, step = recording_trainer(config, events, measured)
    packer = build_components(config).packer
    plan = SimpleNamespace(max_model_len=512, trainer_memory=plan_memory)
    trainer.prepared = SimpleNamespace(plan=plan, components=SimpleNamespace(packer=packer))
    trainer.started_at, trainer.startup = 0.0, {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA H100 80GB HBM3")
    return trainer, step, packer.rows(512)[1]


def test_with_this_shapes_figure_recorded_vllm_launches_before_the_model_loads(tmp_path, monkeypatch):
    """A warm machine: the figure is known before the model is, so vLLM's boot overlaps the model's load too; the
    warm-up that follows neither launches it again nor moves its launch time, and records its own figure."""
    monkeypatch.setenv("ASYNCRL_CACHE_DIR", str(tmp_path))
    config = to_config(compose([]))
    recorded, measured = TrainerMemory(4 * GIB, GIB, 80 * GIB), TrainerMemory(4 * GIB + 1, GIB, 80 * GIB)
    events: list[object] = []
    trainer, step, shape = early_trainer(config, events, measured, None, monkeypatch)
    record_memory(config, shape, recorded)
    trainer._launch_early()
    assert events == [("launch", recorded)]
    launched_at = trainer.startup["perf/startup_server_launched_s"]
    trainer.model = torch.nn.Linear(2, 2)
    assert trainer._measure_and_launch(step, shape, cached_memory(config, shape), 0.0) == measured
    assert events == [("launch", recorded), ("step", False, recorded)]
    assert trainer.startup["perf/startup_server_launched_s"] == launched_at
    assert cached_memory(config, shape) == measured


def test_a_room_to_hold_or_no_figure_leaves_vllm_to_the_warm_up(tmp_path, monkeypatch):
    """A held room must be held before vLLM starts (it needs the model's size); no figure needs the warm-up's."""
    monkeypatch.setenv("ASYNCRL_CACHE_DIR", str(tmp_path))
    config = to_config(compose([]))
    events: list[object] = []
    held = TrainerMemory.with_need(50 * GIB, GIB, 80 * GIB)
    for plan_memory in (held, None):
        trainer, _, _ = early_trainer(config, events, held, plan_memory, monkeypatch)
        trainer._launch_early()
        assert events == [] and trainer.server.waits_for_warm_up


def test_with_this_shapes_figure_cached_a_waiting_vllm_launches_before_any_warm_up_step(tmp_path, monkeypatch):
    """A warm machine: vLLM's share comes from the figure an earlier run recorded, so it boots beside the whole
    warm-up (no eager measuring step first); the step's own figure is recorded for the next run."""
    monkeypatch.setenv("ASYNCRL_CACHE_DIR", str(tmp_path))
    config = to_config(compose([]))
    recorded, measured = TrainerMemory(4 * GIB, GIB, 80 * GIB), TrainerMemory(4 * GIB + 1, GIB, 80 * GIB)
    record_memory(config, 512, recorded)
    events: list[object] = []

    trainer, step = recording_trainer(config, events, measured)
    trainer.model = torch.nn.Linear(2, 2)  # _compiles() must not be what decides the order here
    trainer.started_at, trainer.startup = 0.0, {}
    assert trainer._measure_and_launch(step, 512, cached_memory(config, 512), 0.0) == measured
    assert events == [("launch", recorded), ("step", False, recorded)]
    assert cached_memory(config, 512) == measured


def test_a_held_room_leaves_vllm_its_conservative_share_and_a_large_trainer_measures_first():
    """The room a cold gated-DeltaNet warm-up holds on an 80 GiB GPU: vLLM's command takes 0.3 from it (what a
    printed command gets unmeasured), the trainer all the rest but vLLM's context; the 2B shape's static memory
    (~20 GiB in float32) fits twice over, 36 GiB (the real Qwen3.5-2B in float32 is ~28) does not."""
    from asyncrl.serving.vllm import SHARED_GPU_SHARE, VLLM_CONTEXT_BYTES

    room = held_room(80 * GIB, GIB, static_bytes=20 * GIB)
    assert room is not None and room.held and room.context_bytes == GIB + COLD_AUTOTUNE_CONTEXT_BYTES
    assert 0 <= 56 * GIB - VLLM_CONTEXT_BYTES - room.need_bytes <= 2
    rest = room.gpu_bytes - room.need_bytes - VLLM_CONTEXT_BYTES
    assert round(rest / room.gpu_bytes, 2) == SHARED_GPU_SHARE
    assert room.describe() == ("the trainer's room held before its warm-up, 55.0 of the GPU's 80.0 GiB (7.0 GiB of "
                               "it outside its allocator)")  # fmt: skip
    assert held_room(80 * GIB, GIB, static_bytes=36 * GIB) is None
    assert held_room(12 * GIB, GIB, static_bytes=GIB) is None  # the cold autotune's context alone fills the room


def test_a_cold_gated_deltanet_warm_up_holds_its_room_and_launches_vllm_before_its_step(tmp_path, monkeypatch):
    """No figure for the shape and a warm-up that autotunes fla's kernels: the room is held, vLLM launches on it,
    then the step runs in it (one step: no eager measuring step first), and its own figure is kept for the next
    run."""
    from asyncrl.trainer import memory as memory_module

    monkeypatch.setenv("ASYNCRL_CACHE_DIR", str(tmp_path))
    config = to_config(compose([]))
    room = held_room(80 * GIB, GIB, 18 * GIB)
    measured = TrainerMemory(26 * GIB, room.context_bytes, 80 * GIB)
    events: list[object] = []
    monkeypatch.setattr(memory_module, "hold", lambda held: events.append(("hold", held)))  # reserves on CUDA only

    trainer, step = recording_trainer(config, events, measured)
    trainer.started_at, trainer.startup = 0.0, {}
    monkeypatch.setattr(trainer, "_held_room", lambda: room)
    assert trainer._measure_and_launch(step, 512, None, 0.0) == measured
    assert events == [("hold", room), ("launch", room), ("step", False, room)]
    assert cached_memory(config, 512) == measured  # the next run launches vLLM on the measured figure


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the caching allocator's reservation needs CUDA")
def test_in_a_held_room_the_warm_up_allocates_without_growing_the_trainers_footprint(caplog):
    free, total = torch.cuda.mem_get_info()
    with caplog.at_level("WARNING", logger="asyncrl.trainer.memory"):
        hold(TrainerMemory.with_need(2 * int(total), 0, int(total)))  # more than the GPU: said, not raised
    assert "could not hold" in caplog.text
    room = TrainerMemory.with_need(int(torch.cuda.memory_reserved()) + 4 * GIB, 0, int(total))
    hold(room)
    reserved = torch.cuda.memory_reserved()
    assert reserved >= 2 * GIB
    tensors = [torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda") for _ in range(4)]
    assert torch.cuda.memory_reserved() == reserved  # inside the held block
    del tensors


@pytest.mark.slow
def test_after_the_warm_up_a_steps_row_compiles_nothing(random_tiny_vlm_dir, one_rank):
    """As on the GPU: the recipe's model family (a gated-DeltaNet hybrid VLM), FSDP, gradient checkpointing and the
    compiled layers (aot_eager: Dynamo and AOTAutograd without the C++ codegen), an eager then a compiling warm-up,
    then a real group's row: it must compile nothing (a compile there costs the GPU's first step minutes)."""
    import torch._dynamo

    torch._dynamo.reset()
    config = to_config(compose([f"model.name_or_path={random_tiny_vlm_dir}", "packing=tree", "loss=score_centering",
                                "trainer.compile_layers=aot_eager", "sampling.max_completion_length=24",
                                "packing.token_budget=160"]))  # fmt: skip
    components = build_components(config)
    model = fsdp.shard(load_model(config, str(random_tiny_vlm_dir)), config, None)
    optimizer, _ = build_optimizer(config, model)
    row_factory, _ = components.packer.rows(40)
    top_k = config.sampling.num_sampler_logprobs
    rows = synthetic_rows(row_factory, 16, 24, 4, vocab_size=90, top_k=top_k)
    loss = StepLoss(components.loss, components.advantage, 24)
    work = split_rows(rows, [[index] for index in range(len(rows))], loss.norm(rows))[0]  # as the trainer runs them
    with torch.compiler.set_stance("force_eager"):
        warm_up(lambda: warm_up_step(model, loss, work, one_rank, config), model, optimizer)
    warm_up(lambda: warm_up_step(model, loss, work, one_rank, config), model, optimizer)
    rng = random.Random(1)
    prompt = [rng.randrange(90) for _ in range(11)]  # another prompt length, another group size
    step_row = row_factory()
    for index in range(6):
        step_row.add(make_sample(prompt + [rng.randrange(90) for _ in range(20)], len(prompt), 0, index - 2.5, index))
    real = [step_row.pack(top_k)]
    model.train()
    with torch._dynamo.config.patch(error_on_recompile=True):
        train_rows(model, loss, split_rows(real, [[0]], loss.norm(real))[0], one_rank, config)
    torch._dynamo.reset()
