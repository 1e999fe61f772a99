"""Bucketed gathers of FSDP2-sharded parameters: whole, exact, in the serving dtype, whatever the row counts; the
float32 LM head (model.cast_lm_head_to_fp32) as a unit of its own under bf16 mixed precision; float32 master weights
for a vision tower that trains (model.freeze_vision_tower=false)."""

from __future__ import annotations

import faulthandler
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from asyncrl.config.compose import compose, to_config
from asyncrl.packing import TreeRow
from asyncrl.serving.process import free_port
from asyncrl.trainer.distributed import leave
from asyncrl.trainer.forward import packed_forward
from asyncrl.trainer.fsdp import buckets, gather_bucket, shard
from asyncrl.trainer.model import build_optimizer, load_model
from asyncrl.weights.tensors import frozen_prefixes

# as tests/trainer/test_moe.py: a rank this file's tests spawn imports it afresh, with whatever sys.path the worker
# had (benchmarks/packing.py ahead of tests/ once the benchmark scripts ran there), so by a name nothing else has
sys.path.insert(0, str(Path(__file__).parents[1] / "packing"))
from packing_samples import build_tiny_qwen3, random_samples  # noqa: E402

WORLD = 2
SHAPES = [(7, 3), (1, 5), (5,), (4, 4), (2, 3)]  # 7 and 5 rows split unevenly, 1 row leaves rank 1 empty


def test_buckets_hold_consecutive_parameters_under_the_byte_limit():
    params = [torch.zeros(10), torch.zeros(10), torch.zeros(30), torch.zeros(5)]
    assert buckets(params, torch.float32, limit=80) == [range(0, 2), range(2, 3), range(3, 4)]
    assert buckets(params, torch.bfloat16, limit=80) == [range(0, 2), range(2, 4)]  # half the bytes
    assert buckets(params, None) == [range(0, 4)]


def test_buckets_split_where_the_gathered_dtype_changes():
    params = [torch.zeros(3), torch.zeros(3, dtype=torch.long), torch.zeros(3)]
    assert buckets(params, torch.bfloat16) == [range(0, 1), range(1, 2), range(2, 3)]


def rank_main(rank: int, port: int, out: Path) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    faulthandler.enable()  # a crashed rank prints its Python stack
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    try:
        torch.manual_seed(0)
        module = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(shape)) for shape in SHAPES])
        fully_shard(module)
        params = list(module.parameters())
        whole = [p.full_tensor() for p in params]
        got = [t for b in buckets(params, torch.bfloat16, limit=40) for t in gather_bucket([params[i] for i in b],
                                                                                          torch.bfloat16)]  # fmt: skip
        if rank == 0:
            torch.save({"whole": whole, "got": got, "buckets": len(buckets(params, torch.bfloat16, limit=40))},
                       out / "gathered.pt")  # fmt: skip
        dist.barrier()  # tear down together: gloo aborts a rank that destroys the group while the other still talks
    finally:
        dist.destroy_process_group()
    leave(0)


def test_a_bucket_gathers_uneven_shards_whole_in_the_serving_dtype(tmp_path):
    mp.spawn(rank_main, args=(free_port(), tmp_path), nprocs=WORLD)
    result = torch.load(tmp_path / "gathered.pt")
    assert result["buckets"] > 1
    for whole, got, shape in zip(result["whole"], result["got"], SHAPES, strict=True):
        assert got.shape == shape and got.dtype == torch.bfloat16
        assert torch.equal(got, whole.to(torch.bfloat16))


def test_mixed_precision_keeps_a_frozen_base_as_loaded_and_trains_fp32_adapters(random_tiny_model_dir, one_rank):
    """The GPU's policy (bf16 compute, fp32 master weights), here on the CPU: a LoRA base loaded in bf16 stays bf16
    (not doubled to fp32), the adapters train in fp32, and a step runs through the mixed-dtype shards."""
    from transformers import AutoModelForCausalLM

    from asyncrl import lora

    config = to_config(compose([f"model.name_or_path={random_tiny_model_dir}", "lora=default", "lora.r=8"]))
    base = AutoModelForCausalLM.from_pretrained(random_tiny_model_dir, dtype=torch.bfloat16)
    model = shard(lora.wrap(config, base, str(random_tiny_model_dir)), config, torch.bfloat16)
    dtypes = {(p.dtype, p.requires_grad) for p in model.parameters()}
    assert dtypes == {(torch.bfloat16, False), (torch.float32, True)}
    model(input_ids=torch.arange(1, 33)[None]).logits.float().log_softmax(-1).mean().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters() if p.requires_grad)


def test_a_world_of_one_gathers_every_parameter_as_it_is(random_tiny_model_dir, one_rank):
    """One process's sync: the sharded view yields the unsharded model's tensors, names and serving dtype."""
    import copy

    from transformers import AutoModelForCausalLM

    from asyncrl.config.compose import compose, to_config
    from asyncrl.trainer.fsdp import GatheredModel, shard
    from asyncrl.weights.tensors import serving_parameters

    config = to_config(compose([f"model.name_or_path={random_tiny_model_dir}"]))
    plain = AutoModelForCausalLM.from_pretrained(random_tiny_model_dir, dtype=torch.float32)
    view = GatheredModel(shard(copy.deepcopy(plain), config, None), one_rank, torch.bfloat16)
    expected = dict(serving_parameters(plain, torch.bfloat16))
    gathered = dict(serving_parameters(view, torch.bfloat16))
    view.done()
    assert list(gathered) == list(expected)
    assert all(gathered[n].dtype == torch.bfloat16 and torch.equal(gathered[n], expected[n]) for n in expected)


def test_a_saved_model_keeps_its_use_cache_and_the_mode_of_other_files(random_tiny_model_dir, one_rank, tmp_path):
    """The final model/ (and a checkpoint's weights) load for generation as the source did, and under the umask."""
    import json

    from sharded import sharded

    from asyncrl.config.compose import compose, to_config
    from asyncrl.trainer.fsdp import save_weights
    from asyncrl.trainer.model import load_model

    config = to_config(compose([f"model.name_or_path={random_tiny_model_dir}"]))
    model, optimizer, _ = sharded(config, load_model(config, config.model.name_or_path))
    save_weights(tmp_path, model, optimizer, one_rank, None, resumable=False)
    assert json.loads((tmp_path / "config.json").read_text())["use_cache"] is True  # the tiny model's own
    modes = {path.name: path.stat().st_mode & 0o777 for path in tmp_path.iterdir()}
    assert modes["model.safetensors"] == modes["config.json"], modes


def head_inputs_and_weight_dtype(model: torch.nn.Module) -> dict:
    """What the LM head's forward is handed (after FSDP's own pre-forward: gathered, its input cast)."""
    seen: dict = {}

    def hook(module: torch.nn.Module, args: tuple) -> None:
        seen.update(hidden=args[0][0].detach().double(), dtype=module.weight.dtype)

    model.get_output_embeddings().register_forward_pre_hook(hook)
    return seen


@pytest.mark.parametrize("cast", [False, True])
def test_cast_lm_head_to_fp32_computes_the_head_in_float32_under_bf16_mixed_precision(cast, tmp_path, one_rank):
    """The GPU's policy (bf16 compute over fp32 master weights), here on the CPU: with model.cast_lm_head_to_fp32 the
    head is gathered in float32 and the log-probabilities equal a float64 head over its hidden states (float32
    rounding only); without it the head computes in bfloat16, over 100x further off. A step trains the float32 head,
    and a no-grad forward (the reference's) runs after it."""
    build_tiny_qwen3(4).save_pretrained(tmp_path / "untied")
    config = to_config(compose([f"model.name_or_path={tmp_path / 'untied'}", f"model.cast_lm_head_to_fp32={cast}"]))
    model = shard(load_model(config, str(tmp_path / "untied")), config, torch.bfloat16)
    weight = model.get_output_embeddings().weight.detach().full_tensor().double()  # the float32 master weights
    seen = head_inputs_and_weight_dtype(model)
    row = TreeRow(10_000)
    for sample in random_samples(4, num_groups=2, max_group=4):
        row.add(sample)
    packed = row.pack(top_k=0)
    out = packed_forward(model, packed, 0.7, attention="sdpa", logit_chunk_tokens=7)
    logits = seen["hidden"] @ weight.T / 0.7  # the hidden states of the kept positions (logits_to_keep)
    expected = logits.log_softmax(-1).gather(1, packed.target_ids[:, None]).squeeze(1)
    error = (out.logprobs.double() - expected).abs().max().item()
    assert seen["dtype"] == (torch.float32 if cast else torch.bfloat16)
    assert (error < 1e-5) if cast else (error > 1e-4), error  # measured: 3e-7 and 1e-3
    optimizer, _ = build_optimizer(config, model)
    out.logprobs.sum().backward()
    head = model.get_output_embeddings().weight
    assert head.dtype == head.grad.dtype == torch.float32 and head.grad.full_tensor().abs().sum() > 0
    optimizer.step()
    with torch.no_grad():  # the reference's forwards (trainer/reference.py): the head gathered in float32 again
        again = packed_forward(model, packed, 0.7, attention="sdpa", logit_chunk_tokens=7)
    assert seen["dtype"] == (torch.float32 if cast else torch.bfloat16)
    assert not torch.equal(again.logprobs, out.logprobs)  # the step moved the weights


@pytest.mark.parametrize("freeze", [True, False])
def test_a_trained_vision_tower_gets_float32_master_weights_under_mixed_precision(
    random_tiny_vlm_dir, one_rank, freeze
):
    """Loaded in bfloat16 and sharded under the GPU's bf16 policy: what trains gets float32 master weights (and so
    float32 optimizer state), the vision tower too with model.freeze_vision_tower=false; a frozen tower stays as
    loaded (half the memory)."""
    overrides = [f"model.name_or_path={random_tiny_vlm_dir}", "model.dtype=bfloat16",
                 f"model.freeze_vision_tower={freeze}"]  # fmt: skip
    config = to_config(compose(overrides))
    model = shard(load_model(config, str(random_tiny_vlm_dir)), config, torch.bfloat16)
    for name, param in model.named_parameters():
        frozen = freeze and name.startswith("model.visual.")
        assert param.dtype == (torch.bfloat16 if frozen else torch.float32) and param.requires_grad != frozen, name
    assert frozen_prefixes(model) == (("model.visual.",) if freeze else ())  # what weight sync skips, once sharded
