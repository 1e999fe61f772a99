"""The trainer's ranks: rank 0 runs the Trainer, the other ranks (none in a world of one) follow its commands.

Rank 0 alone owns the rollout worker, the queue, the server's control client, logging, evaluation and
checkpoint metadata. At each collective point it scatters a command to the followers: ``step`` (this rank's
rows of the step, trained trainer.num_iterations times), ``sync`` (take part in the weight gathers),
``save``/``model`` (write the sharded checkpoint / take part in the consolidated model alone: the final model, a
trainer.save_only_model checkpoint) or ``stop``. A step is micro-batches of one row per rank, balanced by attention
cost (packing/planner.py); a rank whose row in one is empty runs a copy of another row with a zero loss, because
every rank must run the same forwards for FSDP's collectives to pair up; for the same reason a text row of a
micro-batch with images on another rank runs the vision tower on a dummy image (``pair_images``). Each rank divides
its loss by the step's trained tokens summed over all ranks, so the summed gradient is the single-process one.

``python -m asyncrl.trainer.rank_main RUN_DIR`` is one rank (RANK, WORLD_SIZE, MASTER_ADDR/PORT in its
environment); torch's launcher starts them (asyncrl/trainer/launcher.py; torchrun on other nodes). Their process group
is ``Ranks`` (trainer/ranks.py).
"""

from __future__ import annotations

import atexit
import math
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from asyncrl.config.schema import Config
from asyncrl.dtypes import torch_dtype
from asyncrl.losses.step import StepLoss, StepNorm, StepTotals
from asyncrl.packing.attention import unwrap_model
from asyncrl.packing.row import PackedRow
from asyncrl.trainer import fsdp
from asyncrl.trainer.autotune import config_dir, watch
from asyncrl.trainer.forward import trainer_forward
from asyncrl.trainer.model import build_grad_scaler, use_cpu_threads
from asyncrl.trainer.moe import router_aux_coef
from asyncrl.trainer.profiler import phase, wait_for_device
from asyncrl.trainer.ranks import Ranks
from asyncrl.trainer.reference import Reference, build_reference, reference_logprobs

if TYPE_CHECKING:
    from asyncrl.run_plan import RunPlan
    from asyncrl.trainer.checkpoint import TrainerState

ORPHAN_GRACE_S = 10.0
"""How long a rank whose CLI died may take to end by itself before ``exit_with_parent`` ends it."""
NO_LOSS_SCALING = torch.amp.GradScaler("cpu", enabled=False)
"""A disabled GradScaler (it keeps no state): its calls pass the loss and the optimizer step through unchanged."""


@dataclass
class RankWork:
    """One rank's share of a step: its rows (weight 0 = a filler that only keeps the collectives paired) and
    the step's ``StepNorm``, which needs every row of the step."""

    rows: list[tuple[PackedRow, float]]
    norm: StepNorm


def split_rows(rows: list[PackedRow], placement: list[list[int | None]], norm: StepNorm) -> list[RankWork]:
    """Each micro-batch's row r to rank r (``Step.placement``); a rank with none runs a zero-loss filler, and a text
    row beside another rank's images a dummy image (``pair_images``)."""
    world = len(placement[0]) if placement else 1
    work = [RankWork([], norm) for _ in range(world)]
    for micro in placement:
        if len(micro) != world or all(index is None for index in micro):
            raise ValueError(f"split_rows: micro-batch {micro} must name one row per rank ({world}), not all None")
        placed = pair_images([rows[index] if index is not None else None for index in micro])
        filler = next(row for row in placed if row is not None)
        for rank, row in enumerate(placed):
            work[rank].rows.append((row, 1.0) if row is not None else (filler, 0.0))
    return work


def pair_images(micro: list[PackedRow | None]) -> list[PackedRow | None]:
    """A micro-batch's rows, its text rows marked ``dummy_image`` where another of its rows has images: FSDP gathers
    the vision tower's units (and reduce-scatters a trained tower's gradients) on every rank or on none. Copies, so
    the step's rows stay as packed; a micro-batch of one rank's row is as it was."""
    if all(row is None or row.images is None for row in micro):
        return micro
    return [replace(row, dummy_image=True) if row is not None and row.images is None else row
            for row in micro]  # fmt: skip


@dataclass
class RowsResult:
    forward_s: float
    forward_backward_s: float
    metrics: list[dict[str, float]]
    """Per trained row: the loss's metrics and the row's mean entropy."""
    totals: StepTotals
    """This rank's part of the step's totals; rank 0 adds the ranks' (``StepLoss.end_step``)."""


def train_rows(
    model: torch.nn.Module, loss: StepLoss, work: RankWork, ranks: Ranks, config: Config,
    reference: list[torch.Tensor] | None = None, scaler: torch.amp.GradScaler = NO_LOSS_SCALING,
) -> RowsResult:  # fmt: skip
    """This rank's forwards and backwards of one pass over a step's rows, its loss normalised by the step's
    ``StepNorm`` (all ranks' trained tokens); ``reference``: each row's reference log-probabilities (the KL
    penalty's, trainer/reference.py); ``scaler``: trainer.fp16's loss scaling."""
    forward_s = forward_backward_s = 0.0
    metrics, totals = [], StepTotals()
    for index, (row, weight) in enumerate(work.rows):
        started = time.perf_counter()
        with phase("forward"):
            out = trainer_forward(model, row, config, router_aux=bool(loss.router_aux_coef))
            if weight == 0:
                value = out.logprobs.sum() * 0.0
            else:
                batch = loss.batch(row, out, work.norm, None if reference is None else reference[index])
                value, row_metrics, part = loss.loss(batch, work.norm, out.aux_loss)
                totals = totals + part
                entropy = float(out.entropy.mean()) if out.entropy.numel() else float("nan")
                metrics.append({**row_metrics, "entropy": entropy})
        forward_s += time.perf_counter() - started
        with phase("backward"):
            scaler.scale(value * ranks.world).backward()  # FSDP averages over ranks; the step's gradient is their sum
            wait_for_device()
        forward_backward_s += time.perf_counter() - started
    return RowsResult(forward_s, forward_backward_s, metrics, totals.on_host())


@dataclass
class PassResult:
    """One optimizer pass of a step on this rank, and on rank 0 every rank's (metrics, totals) of it."""

    rows: RowsResult
    grad_norm: float
    optimizer_s: float
    gathered: list[tuple[list[dict[str, float]], StepTotals]]


def train_step(
    model: torch.nn.Module, optimizer: Any, scheduler: Any, loss: StepLoss, work: RankWork, ranks: Ranks,
    config: Config, reference: Reference | None, scaler: torch.amp.GradScaler = NO_LOSS_SCALING,
) -> list[PassResult]:  # fmt: skip
    """This rank's share of one step: trainer.num_iterations optimizer passes over its rows (GRPO's mu). Every
    pass's ratio is against the sampler's log-probabilities the rows carry (pi_old), and the reference's are
    computed once; the learning-rate schedule and the reference's TR-DPO mixing advance once per step. With
    trainer.fp16's ``scaler`` the gradients are unscaled before clipping, and a pass whose gradients overflowed
    skips its optimizer step (its grad_norm is then inf or nan); a step all of whose passes did leaves the schedule
    where it was, as transformers' Trainer does."""
    logprobs = reference_logprobs(reference, [row for row, _ in work.rows], config)
    passes = []
    for _ in range(config.trainer.num_iterations):
        result = train_rows(model, loss, work, ranks, config, logprobs, scaler)
        started = time.perf_counter()
        with phase("optimizer"):
            scaler.unscale_(optimizer)
            grad_norm = fsdp.clip_grad_norm(model, config.trainer.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
        optimizer_s = time.perf_counter() - started
        passes.append(PassResult(result, float(grad_norm), optimizer_s, ranks.gather((result.metrics, result.totals))))
    if not scaler.is_enabled() or any(math.isfinite(one.grad_norm) for one in passes):
        scheduler.step()
    if reference is not None:
        reference.end_step()
    return passes


def warm_up_step(
    model: torch.nn.Module, loss: StepLoss, work: RankWork, ranks: Ranks, config: Config,
    reference: Reference | None = None,
) -> None:  # fmt: skip
    """The warm-up's reference and policy forwards, backward and gradient clipping on every rank (trainer/memory.py
    throws the update away)."""
    train_rows(model, loss, work, ranks, config, reference_logprobs(reference, [row for row, _ in work.rows], config))
    fsdp.clip_grad_norm(model, config.trainer.max_grad_norm)


class Follower:
    """A rank other than 0: the same sharded model and optimizer, driven by rank 0's commands."""

    def __init__(self, plan: RunPlan, run_dir: Path, ranks: Ranks) -> None:
        from asyncrl.trainer.checkpoint import load_checkpoint

        config, components = plan.config, plan.components
        self.config, self.ranks, self.run_dir = config, ranks, run_dir
        use_cpu_threads(config, ranks.world, plan.server_backend)
        self.model, self.optimizer, self.scheduler, resume = build_sharded(config, run_dir, ranks)
        watch(config_dir(run_dir, ranks.rank))  # fla's kernels autotune once each, as on rank 0
        self.scaler = build_grad_scaler(config)
        self.loss = StepLoss(components.loss, components.advantage, config.sampling.max_completion_length)
        self.reference = build_reference(config, self.model, components.loss.options)
        if resume is not None:  # the loss's state is rank 0's: it comes in each StepNorm
            load_grad_scaler(self.scaler, load_checkpoint(resume, self.scheduler))
        self.loss.router_aux_coef = router_aux_coef(config, unwrap_model(self.model).config)
        self.dtype = torch_dtype(plan.serving_dtype)

    def serve(self) -> None:
        while True:
            name, payload = self.ranks.receive()
            if name == "stop":
                return
            if name == "step":
                self._step(payload)
            elif name == "warm_up":
                self._warm_up(payload)
            elif name == "sync":  # payload: the gathered dtype and whether only the adapter is, which set the buckets
                fsdp.serve_gathers(self.model, self.ranks, *payload)
            elif name in ("save", "model"):
                fsdp.save_weights(Path(payload), self.model, self.optimizer, self.ranks, self.dtype,
                                  resumable=name == "save")  # fmt: skip
            else:
                raise RuntimeError(f"trainer rank {self.ranks.rank}: unknown command {name!r} from rank 0")

    def _warm_up(self, work: RankWork) -> None:
        from asyncrl.trainer.memory import warm_up

        warm_up(lambda: warm_up_step(self.model, self.loss, work, self.ranks, self.config, self.reference),
                self.model, self.optimizer)  # fmt: skip

    def _step(self, work: RankWork) -> None:
        self.model.train()
        train_step(self.model, self.optimizer, self.scheduler, self.loss, work, self.ranks, self.config, self.reference,
                   self.scaler)  # fmt: skip


def load_grad_scaler(scaler: torch.amp.GradScaler, state: TrainerState) -> None:
    """A resumed trainer.fp16 run's loss scale (``Trainer._save`` keeps it), which every rank needs the same; a
    checkpoint without one (saved without fp16) leaves the scale at its start."""
    saved = state.extra.get("grad_scaler")  # a checkpoint's JSON, not a config
    if saved:
        scaler.load_state_dict(saved)


def build_sharded(config: Config, run_dir: Path, ranks: Ranks) -> tuple[Any, Any, Any, Path | None]:
    """Model (loaded, then sharded), optimizer, scheduler, and the checkpoint resumed from, whose sharded
    weights and optimizer state are then loaded, resharded for these ranks (its scheduler and TrainerState are
    the caller's)."""
    from transformers import set_seed

    from asyncrl.trainer.checkpoint import resolve_checkpoint
    from asyncrl.trainer.model import build_optimizer, load_model, mixed_precision_dtype

    output_dir = Path(config.trainer.output_dir or run_dir)
    spec = config.trainer.resume_from_checkpoint
    resume = resolve_checkpoint(spec, output_dir) if spec else None
    set_seed(config.trainer.seed)  # every rank initialises new weights (LoRA's A) alike: each keeps its own shard
    model = load_model(config, str(resume) if resume else config.model.name_or_path)
    model = fsdp.shard(model, config, mixed_precision_dtype(config))
    optimizer, scheduler = build_optimizer(config, model)
    if resume is not None:
        fsdp.load_sharded(resume, model, optimizer)
    return model, optimizer, scheduler, resume


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
