"""LoRA weight sync, merged vs adapter-only: bytes and seconds per sync through the built-in server's path.

A Qwen3-0.6B-shaped model with random weights built from its config (nothing downloaded) is saved, served by
``python -m asyncrl.engine --enable-lora`` and trained (here: perturbed) as a peft LoRA model (r=32,
all-linear). Each mode runs ``--syncs`` syncs with the trainer's own code: merged = ``WeightSync`` with the
file transport (pause, full merged weights, resume), adapter = ``AdapterSync`` (write the adapter, load it
under a new name, unload the oldest). After the syncs each mode decodes a few concurrent requests on the
policy it produced (the base name after merged syncs, the adapter's name after adapter syncs), which gives
the per-token price of serving an adapter. With $OUT set, the results also go to $OUT/lora_sync.json:

    python benchmarks/lora_sync.py                     # the GPU run: Qwen3-0.6B shape, bf16 serving
    python benchmarks/lora_sync.py --tiny              # a CPU rehearsal of the same code
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import torch
from peft import get_peft_model
from transformers import Qwen3Config, Qwen3ForCausalLM

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from asyncrl import lora  # noqa: E402
from asyncrl.assets.tiny_model import build_tokenizer  # noqa: E402
from asyncrl.client import ControlClient, ensure_token  # noqa: E402
from asyncrl.config.schema import Config, LoraConfig, ModelConfig, ServerConfig, StalenessConfig  # noqa: E402
from asyncrl.plan.assemble import build_plan  # noqa: E402
from asyncrl.serving.process import ServerProcess, free_port  # noqa: E402
from asyncrl.trainer.weight_sync import WeightSync  # noqa: E402
from asyncrl.weights.adapter import AdapterSync  # noqa: E402
from asyncrl.weights.file_transport import FileTransport  # noqa: E402


def model_config(tiny: bool) -> Qwen3Config:
    if tiny:
        return Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                           tie_word_embeddings=True)  # fmt: skip
    return Qwen3Config(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=4096, tie_word_embeddings=True,
    )  # fmt: skip


def torch_dtype(name: str) -> torch.dtype:
    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[name]


def perturb_adapters(model: torch.nn.Module, seed: int) -> None:
    """Stand-in for an optimizer step: every trainable (adapter) weight moves."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.requires_grad:
                param.add_(torch.randn(param.shape, generator=generator).to(param.device) * 1e-3)


def decode_tokens_per_s(base_url: str, model: str, vocab: int, requests: int, tokens: int) -> float:
    """Generated tokens per second over ``requests`` concurrent requests of ``tokens`` tokens each."""

    def one(seed: int) -> int:
        params = {"max_tokens": tokens, "ignore_eos": True, "seed": seed, "temperature": 1.0}
        body = {"model": model, "token_ids": [(seed * 7 + i) % vocab for i in range(16)], "sampling_params": params}
        response = httpx.post(f"{base_url}/inference/v1/generate", json=body, timeout=600)
        response.raise_for_status()
        return len(response.json()["choices"][0]["token_ids"])

    started = time.perf_counter()
    with ThreadPoolExecutor(requests) as pool:
        generated = sum(pool.map(one, range(requests)))
    return generated / (time.perf_counter() - started)


def run_mode(mode: str, sync: Any, model: torch.nn.Module, args: argparse.Namespace, base_url: str) -> dict:
    seconds, sizes = [], []
    sync.init(model)
    for version in range(1, args.syncs + 1):
        perturb_adapters(model, seed=version)
        metrics = sync.push(model, version)
        seconds.append(metrics["perf/weight_sync_s"])
        sizes.append(metrics["perf/weight_sync_bytes"])
    name = sync.name(args.syncs) if mode == "adapter" else sync.control.served_model_name()
    speed = decode_tokens_per_s(base_url, name, model.config.vocab_size, args.requests, args.tokens)
    sync.close()
    return {"mode": mode, "syncs": args.syncs, "bytes_per_sync": statistics.median(sizes),
            "s_per_sync_median": statistics.median(seconds), "s_per_sync_all": seconds,
            "decode_tokens_per_s": speed}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a tiny shape on the CPU (rehearsal)")
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--syncs", type=int, default=5)
    parser.add_argument("--requests", type=int, default=8, help="concurrent decode requests after the syncs")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per decode request")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    serve_dtype = "bfloat16" if device == "cuda" else "float32"
    work = Path(tempfile.mkdtemp(prefix="lora-sync-bench-"))
    torch.manual_seed(0)
    base = Qwen3ForCausalLM(model_config(args.tiny))
    base.save_pretrained(work / "model")
    build_tokenizer().save_pretrained(work / "model")
    config = Config(model=ModelConfig(name_or_path=str(work / "model")), staleness=StalenessConfig(max_staleness=1),
                    lora=LoraConfig(enabled=True, r=args.rank, alpha=2 * args.rank),
                    server=ServerConfig(dtype=serve_dtype))  # fmt: skip
    model = get_peft_model(base.to(device), lora.peft_config(config)).eval()
    rank = next(r for r in (8, 16, 32, 64, 128, 256, 320, 512) if r >= args.rank)
    port = free_port()
    argv = [sys.executable, "-m", "asyncrl.engine", "--model", str(work / "model"), "--port", str(port),
            "--device", device, "--dtype", serve_dtype, "--max-model-len", "1024", "--enable-lora",
            "--max-loras", "3", "--max-lora-rank", str(rank), "--weights-dir", str(work)]  # fmt: skip
    ensure_token()  # the server and this process's clients share it through the environment
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    with ServerProcess(argv, base_url=f"http://127.0.0.1:{port}", log_path=work / "server.log",
                       env={"PYTHONPATH": path, **({"OMP_NUM_THREADS": "1"} if device == "cpu" else {})},
                       startup_timeout_s=600) as server,\
            ControlClient(server.base_url, timeout_s=600) as control:  # fmt: skip
        merged = WeightSync(control, FileTransport(work, torch_dtype(serve_dtype)))
        plan = build_plan(config)  # the flow rules and serving dtype a run's plan gives the sync
        adapter = AdapterSync(control, config, work, flow=plan.flow, dtype=plan.serving_dtype)
        results = [run_mode("merged", merged, model, args, server.base_url),
                   run_mode("adapter", adapter, model, args, server.base_url)]  # fmt: skip
    shutil.rmtree(work, ignore_errors=True)
    report(results, device, serve_dtype, args)


def report(results: list[dict], device: str, dtype: str, args: argparse.Namespace) -> None:
    shape = "tiny" if args.tiny else "Qwen3-0.6B"
    print(f"\nLoRA sync, {shape} shape, r={args.rank} all-linear, serving {dtype} on {device}, {args.syncs} syncs")
    print(f"{'mode':<8} {'MB/sync':>12} {'s/sync (median)':>16} {'decode tok/s':>13}")
    for r in results:
        print(f"{r['mode']:<8} {r['bytes_per_sync'] / 1e6:>12.2f} {r['s_per_sync_median']:>16.3f} "
              f"{r['decode_tokens_per_s']:>13.1f}")  # fmt: skip
    merged, adapter = results
    print(f"adapter/merged: bytes {adapter['bytes_per_sync'] / merged['bytes_per_sync']:.4f}, "
          f"seconds {adapter['s_per_sync_median'] / merged['s_per_sync_median']:.3f}, "
          f"decode speed {adapter['decode_tokens_per_s'] / merged['decode_tokens_per_s']:.3f}")  # fmt: skip
    out = os.environ.get("OUT")
    if out:
        payload = {"shape": shape, "rank": args.rank, "device": device, "dtype": dtype, "results": results}
        Path(out, "lora_sync.json").write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
