"""Two trainer ranks on CPU (gloo, FSDP2) against one process on the same rows: the same parameter update,
the same weights on the built-in server after a sync, a consolidated checkpoint equal to the unsharded model; images
on one rank only (a vision-language model, its tower frozen or trained).

The two ranks are two "nodes" of one rank each: two of torch's elastic agents (threads here) meet at a c10d
rendezvous on a free loopback port, as `asyncrl train` and a second node's torchrun do. One such launch (module
fixture) serves every test: its ranks make a full model's step, then a LoRA model's, each built anew as a run's
ranks build it (starting ranks costs seconds each on CPU).
"""

from __future__ import annotations

import faulthandler
import json
import math
import os
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from packing.packing_samples import make_sample, random_samples  # tests/packing
from peft import get_peft_model_state_dict
from safetensors.torch import load_file, save_file
from sharded import sharded
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.launcher.api import LaunchConfig, elastic_launch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, set_seed

from asyncrl.config.compose import compose, to_config
from asyncrl.config.schema import Config
from asyncrl.losses import LOSSES
from asyncrl.losses.step import StepLoss, StepNorm
from asyncrl.model_kind import non_text_prefixes
from asyncrl.packing import TreeRow, plan_micro_batches
from asyncrl.rollout.types import PromptImages
from asyncrl.serving.command import served_model_name
from asyncrl.serving.process import free_port
from asyncrl.trainer import fsdp
from asyncrl.trainer.assembler import Step
from asyncrl.trainer.checkpoint import TrainerState
from asyncrl.trainer.distributed import load_grad_scaler, split_rows, train_step
from asyncrl.trainer.forward import packed_forward
from asyncrl.trainer.model import build_optimizer, load_model
from asyncrl.trainer.ranks import SERVER_URL_ENV, Ranks
from asyncrl.weights.tensors import unique_state_dict

from .test_weight_sync import served_vs_local

pytestmark = pytest.mark.slow  # the module fixture starts a two-rank world: 20-45 s on CI's cores

WORLD = 2


def make_config(model_dir: Path, data_dir: Path, *extra: str) -> Config:
    """Adam's first step is lr * g / (|g| + eps): with the default eps 1e-8, the few hundred gradient entries of
    ~1e-8 here turn float rounding (sharded vs unsharded sums, and CPUs with other kernels) into differences of
    O(lr); CI saw 1.6e-3. eps 1e-4 bounds that gain at lr / eps = 10 and still moves the weights by up to lr."""
    return to_config(compose([
        f"model.name_or_path={model_dir}", f"data.path={data_dir / 'train.jsonl'}", "model.dtype=float32",
        "trainer.learning_rate=1e-3", "trainer.adam_epsilon=1e-4", "trainer.max_grad_norm=0.5",
        f"trainer.num_processes={WORLD}", "trainer.gradient_checkpointing=false", "loss=clipped", *extra,
    ]))  # fmt: skip


def make_step(model_dir: Path, budget: int = 96) -> tuple[list, list[list[int | None]]]:
    """Packed tree rows and their placement on the ranks: the first micro-batch the planner makes for 2 ranks and
    its last one, where rank 1's row is empty (it runs a zero-loss filler). Sampler log-probabilities are near
    the model's own, so that the clipped loss has a gradient."""
    samples = [s for s in random_samples(seed=8, num_groups=6, max_group=6) if s.num_tokens <= budget]
    micro_batches, _ = plan_micro_batches(samples, lambda: TreeRow(budget), WORLD, budget)
    step = Step.of([micro_batches[0], micro_batches[-1]], wait_s=0.0)
    placement = step.placement
    assert placement == [[0, 1], [2, None]]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return near_own_logprobs(model, [row.pack(0) for row in step.rows]), placement


def near_own_logprobs(model: torch.nn.Module, packed: list) -> list:
    """The packed rows, their sampler log-probabilities set near the model's own (so that the clipped loss has a
    gradient)."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for row in packed:
            own = packed_forward(model, row, 1.0).logprobs
            row.sampler_logprobs = (own + 0.05 * torch.randn(own.shape, generator=generator)).to(row.sampler_logprobs)
    return packed


def image_group(config: Any, images: PromptImages | None, group: int, prompt: list[int],
                completions: list[list[int]]) -> list:  # fmt: skip
    """A group of samples of ``prompt``, with ``images``' one image after its first two tokens (None: text), and
    ``completions``; ``config``: the vision-language model's, for its vision tokens."""
    if images is not None:
        run = [config.image_token_id] * (int(images.image_grid_thw[0].prod()) // images.merge_size**2)
        prompt = [*prompt[:2], config.vision_start_token_id, *run, config.vision_end_token_id, *prompt[2:]]
    samples = []
    for c, completion in enumerate(completions):
        sample = make_sample(prompt + completion, len(prompt), group, 0.6 * c - 0.5, seed=10 * group + c)
        sample.sequence.images = images
        samples.append(sample)
    return samples


def make_image_step(model_dir: Path) -> tuple[list, list[list[int | None]]]:
    """Rank 0's rows have images and rank 1's none: micro-batches [image row, text row] (rank 1 runs the vision
    tower on a dummy image beside rank 0's images) and [image row, none] (rank 1 runs a zero-loss copy of it)."""
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    config, vision = model.config, model.config.vision_config
    width = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    generator = torch.Generator().manual_seed(1)

    def image(grid: list[int]) -> PromptImages:
        pixels = torch.randn(grid[0] * grid[1] * grid[2], width, generator=generator)
        return PromptImages(pixels, torch.tensor([grid]), config.image_token_id, vision.spatial_merge_size)

    groups = [image_group(config, image([1, 4, 4]), 0, [3, 4, 5, 6], [[10, 11, 12], [10, 13], [14, 15, 16, 17]]),
              image_group(config, None, 1, [3, 4, 7, 8, 9], [[20, 21], [22, 23, 24]]),
              image_group(config, image([1, 2, 6]), 2, [3, 4, 30], [[31, 32], [33]])]  # fmt: skip
    rows = [TreeRow(256) for _ in range(4)]
    for row, group in zip(rows, groups, strict=False):
        for sample in group:
            row.add(sample)
    step = Step.of([[rows[0], rows[1]], [rows[2], rows[3]]], wait_s=0.0)
    assert step.placement == [[0, 1], [2, None]]
    return near_own_logprobs(model, [row.pack(0) for row in step.rows]), step.placement


def single_process_step(config: Config, rows: list) -> torch.nn.Module:
    """The reference: every row through one unsharded model (initialised as the ranks' are), one optimizer step."""
    set_seed(config.trainer.seed)
    model = load_model(config, config.model.name_or_path)
    optimizer, _ = build_optimizer(config, model)
    loss = StepLoss(LOSSES.build(config.loss))
    norm = loss.norm(rows)
    for row in rows:
        out = packed_forward(model, row, config.sampling.temperature)
        loss.loss(loss.batch(row, out, norm), norm)[0].backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), config.trainer.max_grad_norm)
    optimizer.step()
    return model.eval()


def node_main(inputs: str, lead: str) -> None:
    """One node's rank, as its launcher starts it: the leading node's (the one that holds the server's URL, as
    `asyncrl train`'s does) becomes trainer rank 0, whatever rank the rendezvous gave its node."""
    jobs, server_url = torch.load(inputs, weights_only=False)
    os.environ.pop(SERVER_URL_ENV, None)
    if lead == "lead":
        os.environ[SERVER_URL_ENV] = server_url
    faulthandler.enable()  # a crashed rank prints its Python stack
    import torch.distributed as dist

    from asyncrl.trainer.distributed import leave

    ranks = Ranks.from_env()
    try:
        for config, rows, placement, out in jobs:
            rank_main(ranks, config, rows, placement, out, server_url)
    finally:
        dist.destroy_process_group()
    leave(0)


def rank_main(ranks: Ranks, config: Config, rows: list, placement: list, out: Path, server_url: str) -> None:
    """One rank's job: rank 0 leads the trainer's step, sync and save sequence; rank 1 is a real Follower."""
    import torch.distributed as dist

    from asyncrl.model_kind import is_vision_language
    from asyncrl.plan.assemble import build_plan
    from asyncrl.trainer import fsdp
    from asyncrl.trainer.distributed import Follower, build_sharded, split_rows, train_rows

    if ranks.rank != 0:
        Follower(build_plan(config), out, ranks).serve()
        dist.barrier()  # leave together (see asyncrl.trainer.rank_main.main)
        return
    model, optimizer, scheduler, _ = build_sharded(config, out, ranks)
    loss = StepLoss(LOSSES.build(config.loss))
    mine = ranks.command("step", split_rows(rows, placement, loss.norm(rows)))
    result = train_rows(model, loss, mine, ranks, config)
    fsdp.clip_grad_norm(model, config.trainer.max_grad_norm)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    metrics = [m for per_rank, _ in ranks.gather((result.metrics, result.totals)) for m in per_rank]
    if config.lora.enabled:
        write_lora(model, ranks, out)
    elif is_vision_language(model.config):  # the tiny server serves the text model: the weights alone
        ranks.command("model", [str(out / "ckpt")] * WORLD)
        fsdp.save_weights(out / "ckpt", model, optimizer, ranks, torch.float32, resumable=False)
    else:
        save_and_sync(model, optimizer, ranks, out, server_url)
    ranks.command("stop")
    (out / "result.json").write_text(json.dumps({"rows_per_rank": [len(w.rows) for w in split_rows(
        rows, placement, StepNorm())], "row_metrics": len(metrics)}))  # fmt: skip
    dist.barrier()


def save_and_sync(model: torch.nn.Module, optimizer: Any, ranks: Ranks, out: Path, server_url: str) -> None:
    """Rank 0: a resumable checkpoint, then a weight sync to the built-in server, from the shards."""
    from asyncrl.client import ControlClient
    from asyncrl.trainer.weight_sync import WeightSync
    from asyncrl.weights.file_transport import FileTransport

    ranks.command("save", [str(out / "ckpt")] * WORLD)
    fsdp.save_weights(out / "ckpt", model, optimizer, ranks, torch.float32, resumable=True)
    ranks.command("sync", [(torch.float32, False)] * WORLD)
    view = fsdp.GatheredModel(model, ranks, torch.float32)
    with ControlClient(server_url, timeout_s=60) as control:
        sync = WeightSync(control, FileTransport(out, torch.float32))
        sync.init(view)
        try:
            sync.push(view, 1)
        finally:
            view.done()
            sync.close()


def write_lora(model: torch.nn.Module, ranks, out: Path) -> None:
    """Rank 0: the merged weights a merged sync sends, and the adapter an adapter sync writes, from the shards."""
    from asyncrl.weights.adapter import write_adapter

    ranks.command("sync", [(None, False)] * WORLD)
    view = fsdp.GatheredModel(model, ranks, None)
    save_file(unique_state_dict(view), str(out / "merged.safetensors"))
    view.done()
    ranks.command("sync", [(None, True)] * WORLD)
    view = fsdp.GatheredModel(model, ranks, None, trainable_only=True)
    write_adapter(view, out / "adapter", None)
    view.done()


BOOT = "import sys; sys.path.insert(0, sys.argv[1]); import trainer.test_distributed as t; t.node_main(*sys.argv[2:])"


def launch_nodes(inputs: Path, logs: Path) -> None:
    """Two elastic agents of one rank each (nnodes=2) at a c10d rendezvous on a free loopback port; the first
    leads. Agents off the main thread leave the signal handlers alone."""
    endpoint = f"127.0.0.1:{free_port()}"
    failed: list[BaseException] = []

    def agent(lead: str) -> None:
        config = LaunchConfig(min_nodes=2, max_nodes=2, nproc_per_node=1, run_id="two-nodes", rdzv_backend="c10d",
                              rdzv_endpoint=endpoint, max_restarts=0, local_addr="127.0.0.1",
                              logs_specs=DefaultLogsSpecs(log_dir=str(logs / lead)))  # fmt: skip
        try:
            elastic_launch(config, sys.executable)("-c", BOOT, str(Path(__file__).parents[1]), str(inputs), lead)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the test's thread
            failed.append(exc)

    threads = [threading.Thread(target=agent, args=(lead,)) for lead in ("lead", "follow")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failed, failed


@pytest.fixture(scope="module")
def worlds(
    random_tiny_model_dir, random_tiny_vlm_dir, arithmetic_data_dir, tiny_server, tmp_path_factory
) -> dict[str, tuple]:
    """One launch of two nodes, whose ranks run four jobs in turn: on the same text rows "full" (a step, a
    resumable checkpoint, a sync to the server) and "lora" (a LoRA step, its merged weights and its adapter); on the
    tiny VLM's rows, images on rank 0 only, "vlm" (a step, vision tower frozen) and "vlm_tower" (the tower trained),
    each then its weights. Each job's (config, rows, output directory)."""
    root = tmp_path_factory.mktemp("ranks")
    rows, placement = make_step(random_tiny_model_dir)
    configs = {"full": make_config(random_tiny_model_dir, arithmetic_data_dir),
               "lora": make_config(random_tiny_model_dir, arithmetic_data_dir, "lora=default", "lora.r=8")}  # fmt: skip
    image_rows = make_image_step(random_tiny_vlm_dir)
    configs["vlm"] = make_config(random_tiny_vlm_dir, arithmetic_data_dir)
    configs["vlm_tower"] = make_config(random_tiny_vlm_dir, arithmetic_data_dir, "model.freeze_vision_tower=false")
    steps = {name: image_rows if name.startswith("vlm") else (rows, placement) for name in configs}
    jobs = [(config, *steps[name], root / name) for name, config in configs.items()]
    for *_, out in jobs:
        out.mkdir()
    torch.save((jobs, tiny_server.base_url), root / "inputs.pt")
    launch_nodes(root / "inputs.pt", root / "logs")
    return {name: (config, steps[name][0], root / name) for name, config in configs.items()}


@pytest.fixture(scope="module")
def two_ranks(worlds):
    return worlds["full"]


@pytest.fixture(scope="module")
def reference(two_ranks) -> torch.nn.Module:
    config, rows, _ = two_ranks
    model = single_process_step(config, rows)
    model.set_attn_implementation("sdpa")  # plain forwards from here on
    return model.requires_grad_(False)


def test_two_ranks_make_the_single_process_update(two_ranks, reference):
    config, rows, out = two_ranks
    saved = load_file(str(out / "ckpt" / "model.safetensors"))
    names = [name for name, _ in reference.named_parameters()]
    assert set(saved) >= set(names)
    start = AutoModelForCausalLM.from_pretrained(config.model.name_or_path, dtype=torch.float32).requires_grad_(False)
    moved = max(float((p - q).abs().max()) for (_, p), (_, q) in zip(reference.named_parameters(),
                                                                   start.named_parameters(), strict=True))  # fmt: skip
    worst = max(float((saved[name] - param).abs().max()) for name, param in reference.named_parameters())
    assert moved > 1e-4 and worst <= 1e-5, (moved, worst)
    result = json.loads((out / "result.json").read_text())
    assert result == {"rows_per_rank": [2, 2], "row_metrics": len(rows)}


@pytest.mark.parametrize("job", ["vlm", "vlm_tower"])
def test_images_on_one_rank_make_the_single_process_update(worlds, job):
    """Rank 0's rows have images and rank 1's none (beside them it runs the vision tower on a dummy image): the step
    is one process's over all the rows, the tower frozen (the default: it stays as loaded) or trained
    (model.freeze_vision_tower=false: it moves as one process moves it)."""
    config, rows, out = worlds[job]
    reference = single_process_step(config, rows)
    saved = load_file(str(out / "ckpt" / "model.safetensors"))
    start = AutoModelForImageTextToText.from_pretrained(config.model.name_or_path, dtype=torch.float32)
    tower = non_text_prefixes(reference)
    moved = {"text": 0.0, "tower": 0.0}
    for (name, param), (_, initial) in zip(reference.named_parameters(), start.named_parameters(), strict=True):
        assert float((saved[name] - param.detach()).abs().max()) <= 1e-5, name
        part = "tower" if name.startswith(tower) else "text"
        moved[part] = max(moved[part], float((param.detach() - initial.detach()).abs().max()))
    assert tower and moved["text"] > 1e-4
    assert moved["tower"] > 1e-4 if job == "vlm_tower" else moved["tower"] == 0.0
    result = json.loads((out / "result.json").read_text())
    assert result == {"rows_per_rank": [2, 2], "row_metrics": len(rows)}


def test_a_text_row_beside_another_ranks_images_runs_a_dummy_image(random_tiny_vlm_dir):
    """split_rows marks a copy of it (the step's rows stay as packed); a text micro-batch and one rank's rows are
    left as they are."""
    rows, placement = make_image_step(random_tiny_vlm_dir)

    def marks(work: list) -> list:
        return [[(row.images is not None, row.dummy_image, weight) for row, weight in one.rows] for one in work]

    assert marks(split_rows(rows, placement, StepNorm())) == [
        [(True, False, 1.0), (True, False, 1.0)],
        [(False, True, 1.0), (True, False, 0.0)],
    ]
    assert not any(row.dummy_image for row in rows)
    assert split_rows(rows, [[1, 1]], StepNorm())[1].rows[0][0] is rows[1]
    assert marks(split_rows(rows, [[0], [1], [2]], StepNorm())) == [[(True, False, 1.0), (False, False, 1.0),
                                                                      (True, False, 1.0)]]  # fmt: skip


def test_the_server_holds_the_gathered_weights(two_ranks, reference, tiny_server, fresh_server):
    config, _, _ = two_ranks
    try:
        assert served_vs_local(tiny_server.base_url, reference, served_model_name(config)) < 1e-4
    finally:
        fresh_server()


def test_the_two_rank_checkpoint_resumes_on_one_rank(two_ranks, reference, one_rank):
    """torch.distributed.checkpoint reshards: the 2-rank resume files load into a world of one with the same
    weights and the optimizer's state after its one step."""
    config, _, out = two_ranks
    assert any((out / "ckpt" / "sharded").glob("*.distcp")) and (out / "ckpt" / "config.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(config.model.name_or_path, dtype=torch.float32)
    model, optimizer, _ = sharded(config, model)
    fsdp.load_sharded(out / "ckpt", model, optimizer)
    pairs = zip(model.parameters(), reference.parameters(), strict=True)
    worst = max(float((p.detach().to_local() - q).abs().max()) for p, q in pairs)
    assert worst <= 1e-5
    steps = [float(state["step"]) for state in optimizer.state_dict()["state"].values()]
    assert steps and all(step == 1 for step in steps)


@pytest.fixture(scope="module")
def two_lora_ranks(worlds):
    return worlds["lora"]


def test_lora_on_two_ranks_makes_the_single_process_update(two_lora_ranks):
    """The sharded peft model's step equals one process's: the merged weights a merged sync sends and the adapter
    an adapter sync writes (both from gathered shards) match the unsharded peft model's."""
    config, rows, out = two_lora_ranks
    reference = single_process_step(config, rows)
    merged, expected = load_file(str(out / "merged.safetensors")), unique_state_dict(reference)
    assert set(merged) == set(expected)
    assert max(float((merged[name] - expected[name]).abs().max()) for name in expected) <= 1e-5
    adapter = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    trained = get_peft_model_state_dict(reference)
    assert set(adapter) == set(trained) and any("lora_B" in name for name in adapter)
    assert max(float((adapter[name] - trained[name]).abs().max()) for name in trained) <= 1e-5
    assert max(float(trained[name].abs().max()) for name in trained if "lora_B" in name) > 1e-4  # it moved


def test_num_iterations_makes_that_many_optimizer_passes_over_the_step(
    random_tiny_model_dir, arithmetic_data_dir, one_rank
):
    """trainer.num_iterations=2 (GRPO's mu): two optimizer steps on the same rows, the second one's ratio taken
    with the policy the first moved against the same sampler log-probabilities (pi_old); the learning-rate
    schedule counts the step once."""
    rows, _ = make_step(random_tiny_model_dir)

    def step(iterations: int) -> tuple[list, object]:
        config = make_config(random_tiny_model_dir, arithmetic_data_dir, f"trainer.num_iterations={iterations}",
                             "trainer.lr_scheduler_type=linear", "trainer.max_steps=4")  # fmt: skip
        set_seed(config.trainer.seed)
        model, optimizer, scheduler = sharded(config, load_model(config, config.model.name_or_path))
        loss = StepLoss(LOSSES.build(config.loss))
        work = split_rows(rows, [[index] for index in range(len(rows))], loss.norm(rows))[0]
        return train_step(model, optimizer, scheduler, loss, work, one_rank, config, None), scheduler

    def ratios(one_pass) -> list[float]:
        return [metrics["sampling/importance_sampling_ratio/mean"] for metrics in one_pass.rows.metrics]

    (once,), _ = step(1)
    twice, scheduler = step(2)
    assert len(twice) == 2 and scheduler.last_epoch == 1
    assert ratios(twice[0]) == pytest.approx(ratios(once))  # the first pass is the one-pass step
    assert ratios(twice[1]) != pytest.approx(ratios(twice[0]), rel=1e-4)  # the second sees the moved policy


def test_fp16_loss_scaling_unscales_before_clipping_and_skips_an_overflowing_step(
    random_tiny_model_dir, arithmetic_data_dir, one_rank
):
    """trainer.fp16's GradScaler (on the CPU here, where the run refuses fp16): a scaled step's gradient norm and
    update are the unscaled step's, the clip acting on true gradients; an overflowing one leaves the weights and the
    schedule as they were; the scale a checkpoint keeps is the one a resumed rank starts from."""
    rows, _ = make_step(random_tiny_model_dir)
    config = make_config(random_tiny_model_dir, arithmetic_data_dir)

    def step(scaler: torch.amp.GradScaler | None) -> tuple[float, list[torch.Tensor], int]:
        set_seed(config.trainer.seed)
        model, optimizer, scheduler = sharded(config, load_model(config, config.model.name_or_path))
        loss = StepLoss(LOSSES.build(config.loss))
        work = split_rows(rows, [[index] for index in range(len(rows))], loss.norm(rows))[0]
        extra = () if scaler is None else (scaler,)
        (one,) = train_step(model, optimizer, scheduler, loss, work, one_rank, config, None, *extra)
        return one.grad_norm, [p.detach().full_tensor() for p in model.parameters()], scheduler.last_epoch

    plain_norm, plain, _ = step(None)
    scaled_norm, scaled, scheduled = step(torch.amp.GradScaler("cpu", init_scale=2.0**12))
    assert scaled_norm == pytest.approx(plain_norm, rel=1e-4) and plain_norm > config.trainer.max_grad_norm
    assert max(float((a - b).abs().max()) for a, b in zip(plain, scaled, strict=True)) <= 1e-6 and scheduled == 1
    set_seed(config.trainer.seed)
    initial = [p.detach() for p in load_model(config, config.model.name_or_path).parameters()]
    overflow_norm, kept, scheduled = step(torch.amp.GradScaler("cpu", init_scale=float("inf")))
    assert not math.isfinite(overflow_norm) and all(torch.equal(a, b) for a, b in zip(initial, kept, strict=True))
    assert scheduled == 0  # nothing was updated: the schedule waits
    saved = json.loads(json.dumps(torch.amp.GradScaler("cpu", init_scale=2.0**11).state_dict()))  # trainer_state.json
    resumed, fresh = torch.amp.GradScaler("cpu"), torch.amp.GradScaler("cpu")
    load_grad_scaler(resumed, TrainerState(1, 1, 0, 0, {"grad_scaler": saved}))
    load_grad_scaler(fresh, TrainerState(1, 1, 0, 0, {}))  # saved without fp16
    assert (resumed.get_scale(), fresh.get_scale()) == (2.0**11, 2.0**16)
