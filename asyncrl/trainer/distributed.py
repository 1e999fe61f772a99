"""Several trainer ranks: rank 0 runs the Trainer, the other ranks follow its commands.

Rank 0 alone owns the rollout worker, the queue, the server's control client, logging, evaluation and
checkpoint metadata. At each collective point it scatters a command to the followers: ``step`` (this rank's
rows of the step), ``sync`` (take part in the weight gathers), ``save``/``final`` (write the sharded
checkpoint / take part in the consolidated model) or ``stop``. A step is micro-batches of one row per rank,
balanced by attention cost (packing/planner.py); a rank whose row in one is empty runs a copy of another row
with a zero loss, because every rank must run the same forwards for FSDP's collectives to pair up. Each rank
divides its loss by the step's trained tokens summed over all ranks, so the summed gradient is the
single-process one.

``python -m asyncrl.trainer.distributed RUN_DIR`` is one rank (RANK, WORLD_SIZE, MASTER_ADDR/PORT in its
environment); asyncrl/trainer/supervise.py starts them.
"""

from __future__ import annotations

import atexit
import faulthandler
import logging
import os
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from asyncrl.config.schema import Config
from asyncrl.losses.step import StepCounts, StepLoss
from asyncrl.packing.attention import unwrap_model
from asyncrl.packing.row import PackedRow
from asyncrl.parent import exit_with_parent
from asyncrl.trainer import fsdp
from asyncrl.trainer.forward import packed_forward
from asyncrl.trainer.model import use_cpu_threads
from asyncrl.trainer.moe import router_aux_coef
from asyncrl.trainer.profiler import wait_for_device
from asyncrl.trainer.supervise import SERVER_URL_ENV

# Followers wait in a collective while rank 0 waits for rollouts; a dead rank is the supervisor's to catch.
COLLECTIVE_TIMEOUT = timedelta(hours=2)
ORPHAN_GRACE_S = 10.0
"""How long a rank whose CLI died may take to end by itself before ``exit_with_parent`` ends it."""


def world_size(config: Config) -> int:
    """trainer.num_processes, else trainer.gpus on a GPU machine, else 1."""
    t = config.trainer
    if t.num_processes is not None:
        return t.num_processes
    return (t.gpus or 1) if torch.cuda.is_available() else 1


class Ranks:
    """This process's place among the trainer ranks and the few collectives the trainer makes."""

    def __init__(self, rank: int, world: int, device: torch.device) -> None:
        self.rank, self.world, self.device = rank, world, device

    @classmethod
    def from_env(cls) -> Ranks:
        """Join the process group: nccl on GPU (one device per local rank), gloo on CPU."""
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
            device, backend = torch.device("cuda", torch.cuda.current_device()), "nccl"
        else:
            device, backend = torch.device("cpu"), "gloo"
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT)
        return cls(rank, world, device)

    def command(self, name: str, payloads: list[Any] | None = None) -> Any:
        """Rank 0: send ``name`` with payloads[r] to each rank r; returns rank 0's own payload."""
        items = [(name, None if payloads is None else payloads[r]) for r in range(self.world)]
        received: list[Any] = [None]
        dist.scatter_object_list(received, items, src=0)
        return received[0][1]

    def receive(self) -> tuple[str, Any]:
        """A follower: the next command and this rank's payload."""
        received: list[Any] = [None]
        dist.scatter_object_list(received, None, src=0)
        return received[0]

    def announce(self, index: int = 0) -> int:
        """Rank 0 says which parameter to gather next (-1: done); every rank returns that index."""
        value = torch.tensor([index], dtype=torch.long, device=self.device)
        dist.broadcast(value, src=0)
        return int(value.item())

    def sum(self, values: list[float]) -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor)
        return tensor.tolist()

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` on rank 0 (an empty list on the others)."""
        out: list[Any] | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0)
        return out or []


@dataclass
class RankWork:
    """One rank's share of a step: its rows (weight 0 = a filler that only keeps the collectives paired) and
    the step-level advantage shift and scale, which need every rollout of the step."""

    rows: list[tuple[PackedRow, float]]
    affine: tuple[float, float]


def split_rows(rows: list[PackedRow], placement: list[list[int | None]], affine: tuple[float, float]) -> list[RankWork]:
    """Each micro-batch's row r to rank r (``Step.placement``); a rank with none runs a zero-loss filler."""
    world = len(placement[0]) if placement else 1
    work = [RankWork([], affine) for _ in range(world)]
    for micro in placement:
        if len(micro) != world or all(index is None for index in micro):
            raise ValueError(f"split_rows: micro-batch {micro} must name one row per rank ({world}), not all None")
        filler = rows[next(index for index in micro if index is not None)]
        for rank, index in enumerate(micro):
            work[rank].rows.append((rows[index], 1.0) if index is not None else (filler, 0.0))
    return work


@dataclass
class RowsResult:
    forward_s: float
    forward_backward_s: float
    metrics: list[dict[str, float]]
    """Per trained row: the loss's metrics and the row's mean entropy."""


def train_rows(model: torch.nn.Module, loss: StepLoss, work: RankWork, ranks: Ranks, config: Config,
               attention: str) -> RowsResult:  # fmt: skip
    """This rank's forwards and backwards of one step, its loss normalised over all ranks' trained tokens."""
    real = [row for row, weight in work.rows if weight > 0]
    loss.start_step(real)
    loss.shift, loss.scale = work.affine
    tokens, sequences, micro_batches = ranks.sum([loss.counts.tokens, loss.counts.sequences, len(real)])
    loss.counts = StepCounts(int(tokens), int(sequences), int(micro_batches))
    forward_s = forward_backward_s = 0.0
    metrics = []
    for row, weight in work.rows:
        started = time.perf_counter()
        out = packed_forward(model, row, config.sampling.temperature, attention=attention,
                             logit_chunk_tokens=config.trainer.logit_chunk_tokens,
                             compile_layers=config.packing.get("compile_layers", "auto"),
                             router_aux=bool(loss.router_aux_coef))  # fmt: skip
        if weight == 0:
            value = out.logprobs.sum() * 0.0
        else:
            value, row_metrics = loss(loss.batch(row, out), out.aux_loss)
            entropy = float(out.entropy.mean()) if out.entropy.numel() else float("nan")
            metrics.append({**row_metrics, "entropy": entropy})
        forward_s += time.perf_counter() - started
        (value * ranks.world).backward()  # FSDP averages over ranks; the step's gradient is their sum
        wait_for_device()
        forward_backward_s += time.perf_counter() - started
    loss.policy_loss, loss.entropy, loss.loss = ranks.sum([loss.policy_loss, loss.entropy, float(loss.loss)])
    return RowsResult(forward_s, forward_backward_s, metrics)


class Follower:
    """A rank other than 0: the same sharded model and optimizer, driven by rank 0's commands."""

    def __init__(self, config: Config, run_dir: Path, ranks: Ranks) -> None:
        from asyncrl.advantages import ADVANTAGES
        from asyncrl.losses import LOSSES
        from asyncrl.trainer.checkpoint import load_checkpoint

        self.config, self.ranks = config, ranks
        use_cpu_threads(config, ranks.world)
        self.model, self.optimizer, self.scheduler, resume = build_sharded(config, run_dir, ranks)
        self.loss = StepLoss(LOSSES.build(config.loss), ADVANTAGES.build(config.advantage),
                             config.sampling.max_completion_length)  # fmt: skip
        if resume is not None:
            self.loss.load_state_dict(load_checkpoint(resume, self.optimizer, self.scheduler).extra.get("loss", {}))
        self.loss.router_aux_coef = router_aux_coef(config, unwrap_model(self.model).config)
        self.attention = str(config.packing.get("attention", "auto"))
        self.dtype = serving_dtype(config)

    def serve(self) -> None:
        while True:
            name, payload = self.ranks.receive()
            if name == "stop":
                return
            if name == "step":
                self._step(payload)
            elif name == "sync":  # payload: the serving dtype, which sets the buckets
                fsdp.serve_gathers(self.model, self.ranks, payload)
            elif name in ("save", "final"):
                fsdp.save_weights(Path(payload), self.model, self.optimizer, self.ranks, self.dtype,
                                  resumable=name == "save")  # fmt: skip
            else:
                raise RuntimeError(f"trainer rank {self.ranks.rank}: unknown command {name!r} from rank 0")

    def _step(self, work: RankWork) -> None:
        self.model.train()
        result = train_rows(self.model, self.loss, work, self.ranks, self.config, self.attention)
        fsdp.FsdpAccelerator().clip_grad_norm_(self.model.parameters(), self.config.trainer.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.loss.end_step()
        self.ranks.gather(result.metrics)


def serving_dtype(config: Config) -> torch.dtype | None:
    from asyncrl.trainer.sync.tensors import serving_dtype as dtype_of

    return dtype_of(config)


def build_sharded(config: Config, run_dir: Path, ranks: Ranks) -> tuple[Any, Any, Any, Path | None]:
    """Model (loaded, then sharded), optimizer, scheduler, and the checkpoint resumed from, whose sharded
    weights and optimizer state are then loaded (its scheduler and TrainerState are the caller's)."""
    from asyncrl.trainer.checkpoint import check_world_size, resolve_checkpoint
    from asyncrl.trainer.model import build_optimizer, load_model, use_bf16

    output_dir = Path(config.trainer.output_dir or run_dir)
    spec = config.trainer.resume_from_checkpoint
    resume = resolve_checkpoint(spec, output_dir) if spec else None
    if resume is not None:
        check_world_size(resume, ranks.world)
    model = load_model(config, str(resume) if resume else config.model.name_or_path)
    model = fsdp.shard(model, config, mixed_precision=use_bf16(config) and torch.cuda.is_available())
    optimizer, scheduler = build_optimizer(config, model)
    if resume is not None:
        fsdp.load_sharded(resume, model, optimizer)
    return model, optimizer, scheduler, resume


def main(run_dir: Path) -> int:
    """One rank of a multi-rank run, from the run directory's config.yaml."""
    from asyncrl.launch import EXPECTED_ERRORS, _terminate_on_sigterm, load_run_config

    config = load_run_config(run_dir)
    _terminate_on_sigterm()
    faulthandler.enable()  # a rank that crashes leaves its Python stack in its log
    cli = os.getppid()  # a rank waiting inside a collective never runs its SIGTERM handler: leave after a grace
    exit_with_parent(cli, grace_s=ORPHAN_GRACE_S,
                     message=f"trainer rank: the CLI (pid {cli}) is gone; leaving")  # fmt: skip
    ranks = Ranks.from_env()
    if ranks.rank == 0:  # its progress lines ("resumed from ...", checkpoints) reach the terminal as in one process
        logging.basicConfig(level=logging.INFO, format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    try:
        if ranks.rank == 0:
            run_rank_zero(config, run_dir, ranks)
        else:
            Follower(config, run_dir, ranks).serve()
        # Tear the process group down together: a rank that destroys it while another still talks to the
        # store can abort in gloo's threads ("terminate called without an active exception").
        dist.barrier()
    except EXPECTED_ERRORS as exc:
        print(f"error ({type(exc).__name__}): {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # the CLI stops the ranks with SIGTERM and says why itself
        return 130
    finally:
        dist.destroy_process_group()
    return 0


def run_rank_zero(config: Config, run_dir: Path, ranks: Ranks) -> None:
    from asyncrl.server.handle import AttachedServer
    from asyncrl.trainer.loop import run_training
    from asyncrl.trainer.setup import prepare

    server = AttachedServer(os.environ[SERVER_URL_ENV], timeout_s=config.server.timeout, booting=True)
    run_training(config, run_dir, server, prepare(config), ranks=ranks)


def leave(code: int) -> NoReturn:
    """End this rank's process after its process group is destroyed, without the interpreter's teardown.

    Process-group threads can outlive ``destroy_process_group`` (FSDP2 keeps its device meshes), and one that
    touches a Python object while the interpreter tears down aborts the process ("terminate called without an
    active exception"): a rank that finished its work would exit with SIGABRT. Exit handlers still run.
    """
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    leave(main(Path(sys.argv[1])))
