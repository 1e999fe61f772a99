"""Real-vLLM verification (run on the GPU machine; `--backend builtin` rehearses it on a CPU).

    python benchmarks/vllm_e2e.py sync   [--backend vllm]  # launch, startup checks, weight sync, logprob agreement
    python benchmarks/vllm_e2e.py train  [--steps 20]      # `asyncrl train` end to end, per-step sync and cap table
    python benchmarks/vllm_e2e.py broken                   # a launch with one flag broken on purpose must fail clearly
    python benchmarks/vllm_e2e.py lora   [--steps 12]      # adapter sync checked directly, then adapter and merged runs
    python benchmarks/vllm_e2e.py all

Everything runs the embedded default (the tiny-arith model and data) with the server and the trainer on one
GPU (ipc sync), serving in bfloat16. Each phase ends by listing any server or worker process still alive.
``--model qwen3.5-2b`` instead builds a random-weight vision-language checkpoint shaped like Qwen3.5-2B (its text
model: 24 layers, three gated-DeltaNet layers per attention layer; a 4-block vision tower; the tiny-arith
tokenizer's vocabulary) in the output directory, trains it text-only with the length reward (a random model's
arithmetic reward is 0 for every rollout), and checks the vision tower stays as loaded. ``--model qwen3-0.6b`` builds
a random Qwen3-0.6B-shaped checkpoint (28 layers, hidden 1024, tied embeddings) with the same small tokenizer, so its
vocabulary (105) is smaller than its hidden size, the case vLLM's own LoRA warm-up trips on when it wraps the LM head.

The ``lora`` phase serves adapters (``lora=default lora.sync=adapter``, staleness 1: two versions registered):
``AdapterSync`` pushes five perturbed versions, after each the server's logprobs under that version's name are
compared with the trainer's peft model, the retired names must be refused and the live ones served, and requests
started under a version that is retired while they run must end (finished or aborted, never hung). Then the real
CLI trains ``--steps`` steps with adapter sync and with merged sync (staleness 0, so every sample comes from the
synced policy and ``sampling/sampling_logp_difference`` measures the sync itself).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
# A small KV cache (64 blocks of 16 tokens) so that the adaptive cap has room to move with a 3M-parameter model.
VLLM = ["server.backend=vllm", "server.dtype=bfloat16", "server.gpu_memory_utilization=0.25",
        "server.extra_args=[--enforce-eager,--num-gpu-blocks-override,64]"]  # fmt: skip
BUILTIN = ["server.backend=builtin", "server.dtype=float32"]


MODEL: list[str] = []
"""Overrides selecting the model (set by --model), then --extra's."""


def overrides(backend: str) -> list[str]:
    return [*(VLLM if backend == "vllm" else BUILTIN), "data.eval_path=null", "logging.console=plain", *MODEL]


def build_qwen3_5_shape(out: Path, name: str, text: dict[str, Any], vision: dict[str, Any]) -> Path:
    """A random Qwen3.5 vision-language checkpoint (tiny-vlm's config with tied embeddings and 16-pixel patches, as
    Qwen3.5's; ``text`` and ``vision`` override it) with tiny-vlm's tokenizer, in bfloat16, written to
    ``out / name``."""
    from asyncrl.assets.model_families import build_model, save_checkpoint
    from asyncrl.assets.tiny_vlm import build_vlm_config, build_vlm_tokenizer

    tokenizer = build_vlm_tokenizer()
    config = build_vlm_config(tokenizer, **{"tie_word_embeddings": True, **text})
    for key, value in {"patch_size": 16, **vision}.items():
        setattr(config.vision_config, key, value)
    return save_checkpoint(build_model(config, tokenizer).to(torch.bfloat16), tokenizer, out / name)


def build_qwen3_5_2b_shape(out: Path) -> Path:
    """Qwen3.5-2B's shape: 24 layers (three gated-DeltaNet per attention layer), a 4-block vision tower."""
    text = dict(
        hidden_size=2048, intermediate_size=6144, num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2,
        head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
        linear_value_head_dim=128, layer_types=None, max_position_embeddings=4096,
    )  # fmt: skip
    vision = dict(depth=4, hidden_size=1024, intermediate_size=4096, num_heads=16)
    return build_qwen3_5_shape(out, "qwen3.5-2b-shape", text, vision)


def build_qwen3_shape(out: Path, name: str, **dims: int) -> Path:
    """A random Qwen3 checkpoint of ``dims`` (tied embeddings, 4096 positions) with the tiny-arith tokenizer, in
    bfloat16, written to ``out / name``."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from asyncrl.assets.model_families import save_checkpoint
    from asyncrl.assets.tiny_model import build_tokenizer

    tokenizer = build_tokenizer()
    config = Qwen3Config(
        vocab_size=len(tokenizer), max_position_embeddings=4096, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, **dims,
    )  # fmt: skip
    torch.manual_seed(0)
    return save_checkpoint(Qwen3ForCausalLM(config).to(torch.bfloat16), tokenizer, out / name)


def build_qwen3_0_6b_shape(out: Path) -> Path:
    """Qwen3-0.6B's shape: 28 layers, hidden 1024, 16 query / 8 KV heads of 128."""
    return build_qwen3_shape(
        out, "qwen3-0.6b-shape", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128,
    )  # fmt: skip


def build_qwen3_4b_shape(out: Path) -> Path:
    """Qwen3-4B's shape: 36 layers, hidden 2560, FFN 9728, 32 query / 8 KV heads of 128."""
    return build_qwen3_shape(
        out, "qwen3-4b-shape", hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    )  # fmt: skip


# ---- sync: checks, rounds, logprob agreement ----------------------------------------------------------------


Sample = tuple[list[int], list[int], list[float]]  # prompt ids, completion ids, server logprobs


async def sample(base_url: str, name: str, prompts: list[list[int]], seed: int) -> list[Sample]:
    from asyncrl.client import GenerationClient, SamplingParams

    async with GenerationClient(base_url, name, timeout_s=120) as client:
        outs = await asyncio.gather(*(client.complete(p, SamplingParams(max_tokens=24, logprobs=0, seed=seed + i))
                                      for i, p in enumerate(prompts)))  # fmt: skip
    return [(p, o.token_ids, o.logprobs) for p, o in zip(prompts, outs, strict=True)]


def max_diff(model: torch.nn.Module, samples: list[Sample]) -> float:
    """Max |trainer logprob - server logprob| over every sampled token (temperature 1: processed = raw)."""
    device = next(model.parameters()).device
    worst = 0.0
    with torch.no_grad():
        for prompt, tokens, server in samples:
            if not tokens:
                continue
            ids = torch.tensor([prompt + tokens], device=device)
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
            ours = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens, device=device)[:, None]).squeeze(1)
            worst = max(worst, float((ours.cpu() - torch.tensor(server)).abs().max()))
    return worst


def phase_sync(backend: str, out: Path) -> None:
    from asyncrl.client import ControlClient, GenerationClient, SamplingParams
    from asyncrl.config.compose import compose
    from asyncrl.launch import start_server
    from asyncrl.plan.assemble import plan_run
    from asyncrl.serving.command import served_model_name
    from asyncrl.trainer.model import load_model
    from asyncrl.trainer.setup import prepare
    from asyncrl.trainer.weight_sync import WeightSync, build_weight_sync
    from asyncrl.weights.vllm_transports import ipc_transport

    out.mkdir(parents=True, exist_ok=True)
    plan = plan_run(compose([*overrides(backend), f"trainer.output_dir={out}"]), out)
    config, prepared = plan.config, prepare(plan)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    started = time.perf_counter()
    with start_server(plan, out) as server, ControlClient(server.base_url, timeout_s=600) as control:
        print(f"[sync] server {server.backend} healthy after {time.perf_counter() - started:.1f} s; command:")
        print("      ", (out / "commands" / "server.sh").read_text().strip())
        if backend == "vllm":
            info = control.server_info()["vllm_config"]
            model_info = info["model_config"]
            print("[sync] /server_info: logprobs_mode", model_info["logprobs_mode"], "| max_model_len",
                  model_info["max_model_len"], "| weight_transfer_config", info["weight_transfer_config"])  # fmt: skip
        sync = build_weight_sync(plan, control, out)
        print(f"[sync] startup checks passed: {sync.facts}; transport {type(sync.transport).__name__}")
        model = load_model(config, config.model.name_or_path).to(device).eval()
        sync.init(model)
        tower = {k: v.clone() for k, v in model.state_dict().items() if ".visual." in k}
        serving = torch.bfloat16 if config.server.dtype == "bfloat16" else torch.float32
        name = served_model_name(config)
        prompts = [prepared.tokenizer.apply_chat_template(row["prompt"], tokenize=True, add_generation_prompt=True)
                   for row in prepared.dataset.select(range(16))]  # fmt: skip
        prompts = [list(p["input_ids"] if hasattr(p, "keys") else p) for p in prompts]
        base = copy.deepcopy(model).to(serving)
        first = asyncio.run(sample(server.base_url, name, prompts, seed=0))
        print(
            f"[sync] before any change: max |server - trainer| logprob = {max_diff(base, first):.4f} "
            f"(trainer in {serving}), {max_diff(model, first):.4f} (trainer in float32)"
        )
        syncs = [sync]
        if type(sync.transport).__name__ == "DirectIpcTransport":  # vLLM's own ipc engine too, on the same server
            ipc = ipc_transport(config=config, run_dir=out, dtype=plan.serving_dtype)
            engine = WeightSync(control, ipc, sync.facts)
            engine.init(model)
            syncs.append(engine)
        for round_, sync_ in enumerate(syncs):
            for version in range(3 * round_ + 1, 3 * round_ + 4):
                _perturb(model, version, device, scale=0.02)  # a vision tower is frozen: never trained, never synced
                metrics = sync_.push(model, version)
                print(f"[sync] {type(sync_.transport).__name__} round {version}: " + ", ".join(
                    f"{k.removeprefix('perf/weight_sync')}={v:.3f}" for k, v in metrics.items()))  # fmt: skip
            sync_.settle()  # its last resume answered before the next transport pauses the server
            after = asyncio.run(sample(server.base_url, name, prompts, seed=100 + round_))
            trained = copy.deepcopy(model).to(serving)
            print(f"[sync] after 3 syncs by {type(sync_.transport).__name__}: max |server - trainer| = "
                  f"{max_diff(trained, after):.4f} (trainer in {serving}); against the never-synced weights it would "
                  f"be {max_diff(base, after):.4f}")  # fmt: skip

        async def truncated() -> tuple[object, object]:
            async with GenerationClient(server.base_url, name, timeout_s=120) as client:
                params = SamplingParams(top_k=8, top_p=0.9, max_tokens=8, logprobs=0, return_sampling_mask=True)
                out_ = await client.sample(prompts[0], params)
                await client.sample(prompts[1], params)
                return client.candidate_sets, out_.sampling_masks is not None

        candidate_sets, masks = asyncio.run(truncated())
        print(f"[sync] top-k/top-p turns: client.candidate_sets={candidate_sets}, masks returned={masks}")
        if tower:
            same = all(torch.equal(v, model.state_dict()[k]) for k, v in tower.items())
            print(f"[sync] vision tower: {len(tower)} tensors, unchanged on the trainer: {same}")
        for sync_ in syncs:
            sync_.close()
    print(f"[sync] server stopped; leftovers: {leftovers()}")


# ---- lora: adapter versions on the server -------------------------------------------------------------------


def phase_lora(backend: str, out: Path, steps: int, modes: list[str]) -> None:
    from asyncrl.config.compose import compose
    from asyncrl.launch import start_server
    from asyncrl.plan.assemble import plan_run
    from asyncrl.trainer.model import load_model
    from asyncrl.trainer.setup import prepare
    from asyncrl.trainer.weight_sync import build_weight_sync
    from asyncrl.weights.adapter import AdapterSync

    adapter = ["lora=default", "lora.sync=adapter", "staleness.max_staleness=1"]
    out.mkdir(parents=True, exist_ok=True)
    plan = plan_run(compose([*overrides(backend), *adapter, f"trainer.output_dir={out}"]), out)
    config, prepared = plan.config, prepare(plan)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    started = time.perf_counter()
    with start_server(plan, out) as server:
        from asyncrl.client import ControlClient

        print(f"[lora] server {server.backend} healthy after {time.perf_counter() - started:.1f} s; command:")
        print("      ", (out / "commands" / "server.sh").read_text().strip())
        with ControlClient(server.base_url, timeout_s=600) as control:
            sync = build_weight_sync(plan, control, out)
            assert isinstance(sync, AdapterSync), type(sync)
            model = load_model(config, config.model.name_or_path).to(device).eval()
            sync.init(model)
            prompts = _prompts(prepared, 16)
            serving = torch.bfloat16 if config.server.dtype == "bfloat16" else torch.float32
            for version in range(1, 6):
                _perturb(model, version, device, scale=0.05)
                metrics = sync.push(model, version)
                served = asyncio.run(sample(server.base_url, sync.name(version), prompts, seed=10 * version))
                trained = copy.deepcopy(model).to(serving)
                with torch.no_grad(), trained.disable_adapter():
                    baseline = max_diff(trained, served)
                print(f"[lora] v{version}: sync {metrics['perf/weight_sync_s']:.3f} s, "
                      f"{metrics['perf/weight_sync_bytes'] / 1e6:.2f} MB; max |server - trainer| = "
                      f"{max_diff(trained, served):.4f} (against the base model: {baseline:.4f})")  # fmt: skip
            print(f"[lora] registered {[sync.name(v) for v in sync.registered]}; window check: "
                  f"{asyncio.run(_window(server.base_url, sync, prompts[0]))}")  # fmt: skip
            ends = _retired_in_flight(server, sync, model, prompts, device)
            print(f"[lora] requests under a version retired while they run: {ends}")
            sync.close()
    print(f"[lora] server stopped; leftovers: {leftovers()}")
    for mode in modes:
        lora = ["lora=default", f"lora.sync={mode}", "staleness.max_staleness=0", "trainer.learning_rate=2e-4"]
        phase_train(backend, out / f"lora-{mode}", steps, lora)


def _prompts(prepared: object, count: int) -> list[list[int]]:
    """The first ``count`` dataset prompts, rendered with the chat template, as token ids."""
    rows = prepared.dataset.select(range(count))  # type: ignore[attr-defined]
    rendered = [prepared.tokenizer.apply_chat_template(row["prompt"], tokenize=True, add_generation_prompt=True)  # type: ignore[attr-defined]
                for row in rows]  # fmt: skip
    return [list(p["input_ids"] if hasattr(p, "keys") else p) for p in rendered]


def _perturb(model: torch.nn.Module, seed: int, device: str, scale: float) -> None:
    """A stand-in for an optimizer step: every trainable weight moves (LoRA: the adapters only)."""
    with torch.no_grad():
        generator = torch.Generator(device=device).manual_seed(seed)
        for param in model.parameters():
            if param.requires_grad:
                param.add_(torch.randn(param.shape, generator=generator, device=device) * scale)


async def _window(base_url: str, sync: object, prompt: list[int]) -> dict[str, str]:
    """For every version pushed: served, or the server's refusal (only the newest max_staleness + 1 may serve)."""
    from asyncrl.client import GenerationClient, SamplingParams, ServerError

    result = {}
    for version in range(1, 6):
        name = sync.name(version)  # type: ignore[attr-defined]
        try:
            async with GenerationClient(base_url, name, timeout_s=60) as client:
                await client.complete(prompt, SamplingParams(max_tokens=2))
            result[name] = "served"
        except ServerError as error:
            result[name] = f"refused ({error.status})"
    return result


def _retired_in_flight(server: object, sync: object, model: torch.nn.Module, prompts: list[list[int]],
                       device: str) -> str:  # fmt: skip
    """Long requests under the newest version while two more versions are pushed (which retires it): how they end."""
    from asyncrl.client import ControlClient, GenerationClient, SamplingParams

    version = sync.registered[-1]  # type: ignore[attr-defined]
    name = sync.name(version)  # type: ignore[attr-defined]

    async def run() -> list[str]:
        async with GenerationClient(server.base_url, name, timeout_s=120) as client:  # type: ignore[attr-defined]
            with ControlClient(server.base_url) as control:  # type: ignore[attr-defined]
                room = control.max_model_len() - max(len(p) for p in prompts[:8])
            params = SamplingParams(max_tokens=room, min_tokens=room, logprobs=0)  # as long as the context allows
            tasks = [asyncio.create_task(client.sample(p, params)) for p in prompts[:8]]
            await asyncio.sleep(0.2)
            for later in (version + 1, version + 2):
                _perturb(model, later, device, scale=0.05)
                await asyncio.to_thread(sync.push, model, later)  # type: ignore[attr-defined]
            done = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=120)
        return [str(d)[:160] if isinstance(d, BaseException) else f"{d.finish_reason}:{len(d.token_ids)}"
                for d in done]  # fmt: skip

    started = time.perf_counter()
    ends = asyncio.run(run())
    return f"{ends} after {time.perf_counter() - started:.1f} s"


# ---- train and broken: the real CLI --------------------------------------------------------------------------


def cli(args: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
    print("$ asyncrl " + " ".join(args), flush=True)
    return subprocess.run([sys.executable, "-m", "asyncrl", *args], capture_output=True, text=True, env=env,
                          timeout=timeout_s, cwd=REPO)  # fmt: skip


def phase_train(backend: str, out: Path, steps: int, extra: tuple[str, ...] | list[str] = ()) -> None:
    run_dir = out / "train"
    started = time.perf_counter()
    proc = cli(["train", *overrides(backend), *extra, f"trainer.max_steps={steps}", "trainer.save_strategy=no",
                f"hydra.run.dir={run_dir}"], timeout_s=540)  # fmt: skip
    print(f"[train] exit {proc.returncode} after {time.perf_counter() - started:.0f} s")
    if proc.returncode != 0:
        print(proc.stdout[-3000:], proc.stderr[-6000:])
        return
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    keys = ["perf/weight_sync_s", "perf/weight_sync_pause_s", "perf/weight_sync_transfer_s", "rollout/concurrency",
            "rollout/concurrency_cap", "rollout/vllm_kv_cache_usage_frac", "rollout/vllm_running_requests",
            "rollout/vllm_queued_requests", "rollout/vllm_preemption_count", "reward",
            "sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max"]  # fmt: skip
    print("[train] step " + " ".join(k.split("/")[-1] for k in keys))
    for row in rows:
        metrics = row.get("metrics", row)
        print(f"[train] {row.get('step', '?'):>4} " + " ".join(_fmt(metrics.get(k)) for k in keys))
    print(f"[train] server command: {(run_dir / 'commands' / 'server.sh').read_text().strip()}")
    print(f"[train] leftovers: {leftovers()}")


def phase_broken(backend: str, out: Path) -> None:
    broken = "server.extra_args=[--enforce-eager,--logprobs-mode,raw_logprobs]"
    proc = cli(["train", *overrides(backend), broken, "trainer.max_steps=2", f"hydra.run.dir={out / 'broken'}"], 300)
    output = (proc.stdout + proc.stderr).splitlines()
    lines = [line for line in output if "raw_logprobs" in line and "ServerCheck" in line]
    print(f"[broken] exit {proc.returncode}; {lines[-1] if lines else chr(10).join(output[-40:])}")
    print(f"[broken] leftovers: {leftovers()}")


def _fmt(value: object) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def leftovers() -> list[str]:
    """Server, worker and vLLM processes still alive (there should be none)."""
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout.splitlines()
    return [line.strip()[:120] for line in out if ("vllm" in line or "asyncrl" in line) and "vllm_e2e" not in line
            and "ps -eo" not in line]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("phase", choices=["sync", "train", "broken", "lora", "all"])
    parser.add_argument("--backend", choices=["vllm", "builtin"], default="vllm")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--model", choices=["tiny", "qwen3.5-2b", "qwen3-0.6b"], default="tiny")
    parser.add_argument(
        "--extra", nargs="*", default=[], help="more overrides for every phase (e.g. sampling.top_k=20)"
    )
    parser.add_argument("--lora-modes", nargs="*", default=["adapter", "merged"], choices=["adapter", "merged"],
                        help="the lora phase's training runs after its direct check, one per lora.sync")  # fmt: skip
    args = parser.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # a device call's log file keeps its lines in time even when it is cut
    out = args.out or Path(tempfile.mkdtemp(prefix="vllm-e2e-"))
    out.mkdir(parents=True, exist_ok=True)
    if args.model == "qwen3.5-2b":
        VLLM[-1] = "server.extra_args=[--enforce-eager]"  # the KV cache of a 2B model, not 64 blocks
        MODEL.extend([f"model.name_or_path={build_qwen3_5_2b_shape(out)}", "reward=length", "packing=tree",
                      "sampling.max_completion_length=128", "sampling.num_generations=8",
                      "server.gpu_memory_utilization=0.3", "trainer.gradient_checkpointing=true"])  # fmt: skip
    if args.model == "qwen3-0.6b":
        VLLM[-1] = "server.extra_args=[--enforce-eager]"
        MODEL.extend([f"model.name_or_path={build_qwen3_0_6b_shape(out)}", "reward=length",
                      "sampling.max_completion_length=128", "server.gpu_memory_utilization=0.3"])  # fmt: skip
    MODEL.extend(args.extra)
    if args.phase in ("sync", "all"):
        phase_sync(args.backend, out / "sync")
    if args.phase in ("train", "all"):
        phase_train(args.backend, out, args.steps)
    if args.phase in ("broken", "all"):
        phase_broken(args.backend, out)
    if args.phase in ("lora", "all"):
        phase_lora(args.backend, out / "lora", args.steps, args.lora_modes)


if __name__ == "__main__":
    main()
