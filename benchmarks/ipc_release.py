"""Why every run served by vLLM ends with torch's "Producer process has been terminated before all shared CUDA
tensors released" (benchmarks/RESULTS.md, the acceptance run's seventh pass): the ``ipc`` weight buffer's release,
replayed with plain torch on one GPU, in the orders a run can take.

torch counts each CUDA block shared over IPC in a shared-memory slot: the consumer's copy decrements it when it is
freed, and a producer that exits while a slot is still in use prints that warning. Here a producer process (the
trainer's role) shares a buffer with asyncrl's ``encode_handle``; a consumer process (vLLM's worker's role) opens it
with ``WeightBufferExtension``'s map method, reads it, and unmaps it when told; then the producer ends. One line per
scenario: whether the producer's stderr held the warning.

- ``shipped``: the producer drops its buffer, then the consumer unmaps (``DirectIpcTransport.close``'s order);
- ``unmap-first``: the consumer unmaps, then the producer drops its buffer;
- ``stopped-mapped``: the consumer is stopped (SIGTERM) with the buffer mapped (a server stopped before close);
- ``killed``: the consumer is SIGKILLed with the buffer mapped (the vllm-killed row), then the producer drops it;
- ``killed-released``: as ``killed``, then the producer releases the dead consumer's count itself
  (``torch.UntypedStorage._release_ipc_counter``, what torch's own rebuild calls for a handle opened twice).

With ``--vllm`` the consumer is a real vLLM instead, launched by asyncrl for the embedded default model (its run
plan with ipc transfer and 0.3 of the GPU), and the producer is the trainer's own sync (``DirectIpcTransport``:
init, stage, send, then):

- ``vllm-shipped``: ``close`` (the run's end);
- ``vllm-unmap-first``: UNMAP, then the buffer dropped and ``torch.cuda.ipc_collect()``;
- ``vllm-no-close``: the producer exits with the buffer still mapped.

    python benchmarks/ipc_release.py            # on a GPU, ~30 s; --scenario NAME runs one
    python benchmarks/ipc_release.py --vllm     # and the vLLM ones (~2 min: its boot; its log's folder printed)
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from asyncrl.weights.vllm_extension import WeightBufferExtension, encode_handle  # noqa: E402

WARNING = "Producer process has been terminated before all shared CUDA tensors released"
SCENARIOS = ("shipped", "unmap-first", "stopped-mapped", "killed", "killed-released")
VLLM_SCENARIOS = ("vllm-shipped", "vllm-unmap-first", "vllm-no-close")
TINY = REPO / "asyncrl" / "assets" / "tiny-arith"
REF_COUNTER_ARGS = slice(11, 13)  # rebuild_cuda_tensor's ref_counter_handle, ref_counter_offset
BUFFER_BYTES = 64 << 20


def consume(conn: Connection) -> None:
    """The consumer: vLLM's worker's part, through asyncrl's extension, one command at a time."""
    worker = WeightBufferExtension()
    worker.device = torch.device("cuda", 0)  # type: ignore[attr-defined] - vLLM's worker has it
    while True:
        command, argument = conn.recv()
        if command == "map":
            conn.send(worker.asyncrl_map_weight_buffer(argument))
        elif command == "read":
            assert worker._asyncrl_buffer is not None
            conn.send(int(worker._asyncrl_buffer[:4096].sum()))
        elif command == "unmap":
            worker.asyncrl_unmap_weight_buffer()
            conn.send(None)


def produce(scenario: str) -> None:
    """The producer: the trainer's part; ends with the scenario's order of release."""
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # the extension's map refuses a pickled handle without it
    buffer: torch.Tensor | None = torch.ones(BUFFER_BYTES, dtype=torch.uint8, device="cuda")
    context = mp.get_context("spawn")
    conn, child = context.Pipe()
    consumer = context.Process(target=consume, args=(child,), daemon=True)
    consumer.start()
    handle = encode_handle(buffer)
    call(conn, "map", handle)
    assert call(conn, "read") == 4096
    if scenario == "shipped":
        buffer = None
        call(conn, "unmap")
    elif scenario == "unmap-first":
        call(conn, "unmap")
        buffer = None
    elif scenario == "stopped-mapped":
        consumer.terminate()
        consumer.join()
        buffer = None
    else:  # killed, killed-released
        consumer.kill()
        consumer.join()
        buffer = None
        if scenario == "killed-released":
            import base64
            import pickle

            counter_handle, counter_offset = pickle.loads(base64.b64decode(handle))["args"][REF_COUNTER_ARGS]
            torch.UntypedStorage._release_ipc_counter(counter_handle, counter_offset)
    torch.cuda.synchronize()
    print(f"{scenario}: producer done, consumer alive: {consumer.is_alive()}", flush=True)


def produce_for_vllm(scenario: str, url: str) -> None:
    """The producer against a real vLLM: the trainer's ipc sync of the embedded default model, then the scenario's
    end."""
    from transformers import AutoModelForCausalLM

    from asyncrl.client import ControlClient
    from asyncrl.weights.vllm_common import IPC_BUFFER_LIMIT
    from asyncrl.weights.vllm_direct import DirectIpcTransport
    from asyncrl.weights.vllm_extension import UNMAP

    model = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32).cuda()
    control = ControlClient(url, timeout_s=60.0)
    transport = DirectIpcTransport(torch.bfloat16, IPC_BUFFER_LIMIT)
    transport.init(control, model)
    transport.stage(model)
    transport.send(control)
    transport.discard()
    if scenario == "vllm-shipped":
        transport.close(control)
    elif scenario == "vllm-unmap-first":
        control.collective_rpc(UNMAP)
        transport.buffer = None
        torch.cuda.ipc_collect()
    torch.cuda.synchronize()
    print(f"{scenario}: synced {len(transport.chunks)} chunk(s), producer done", flush=True)


def tiny_plan(work: Path) -> Any:
    """The run plan of the embedded default model served by vLLM on the trainer's GPU with ipc weight transfer."""
    from asyncrl.config.compose import compose
    from asyncrl.plan.assemble import plan_run

    overrides = ["server=vllm", "server.weight_transfer=ipc", "server.gpu_memory_utilization=0.3",
                 f"trainer.output_dir={work}"]  # fmt: skip
    return plan_run(compose(overrides), work)


def call(conn: Connection, command: str, argument: object = None) -> object:
    conn.send((command, argument))
    return conn.recv()


def run(scenario: str, url: str | None = None) -> str:
    """One scenario in a fresh producer process: its line."""
    started = time.monotonic()
    argv = [sys.executable, __file__, "--produce", scenario, *(["--url", url] if url else [])]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=180)
    warned = WARNING in done.stderr
    tail = (done.stdout + done.stderr).strip().splitlines()[-1:] if done.returncode else []
    return (f"| {scenario} | {done.returncode} | {'yes' if warned else 'no'} | {time.monotonic() - started:.1f} | "
            f"{' '.join(tail)[:160]} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", choices=SCENARIOS, action="append", help="run this one (repeatable)")
    parser.add_argument("--vllm", action="store_true", help="also the scenarios with a real vLLM as the consumer")
    parser.add_argument("--produce", choices=SCENARIOS + VLLM_SCENARIOS, help=argparse.SUPPRESS)  # a producer
    parser.add_argument("--url", help=argparse.SUPPRESS)  # the vLLM a vllm-* producer syncs to
    args = parser.parse_args()
    if args.produce and args.url:
        produce_for_vllm(args.produce, args.url)
        return
    if args.produce:
        produce(args.produce)
        return
    if not torch.cuda.is_available():
        raise SystemExit("ipc_release: needs a CUDA GPU (CUDA IPC)")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}")
    print("| scenario | exit | warning at the producer's exit | s | last line on failure |\n|---|---|---|---|---|")
    for scenario in args.scenario or SCENARIOS:
        print(run(scenario), flush=True)
    if args.vllm:
        from asyncrl.launch import start_server

        work = Path(tempfile.mkdtemp(prefix="ipc_release-"))
        with start_server(tiny_plan(work), work) as server:  # asyncrl's launch, health wait and stop
            print(f"vLLM: {(work / 'commands' / 'server.sh').read_text().strip()} (log: {work / 'logs'})", flush=True)
            for scenario in VLLM_SCENARIOS:
                print(run(scenario, server.base_url), flush=True)


if __name__ == "__main__":
    main()
