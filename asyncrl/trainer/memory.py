"""The trainer's GPU memory, measured rather than estimated, and what a GPU shared with vLLM leaves the server.

A warm-up step (``warm_up``) runs the step the trainer will run, forward, backward, gradient clipping and an AdamW
step, on a synthetic row shaped like a step's (groups sharing a prompt, filling the token budget), and throws its
update away (the gradients are zeroed before the optimizer steps at learning rate 0, and the optimizer's state is
cleared after). Its peak, read from the CUDA caching allocator, plus the process's CUDA context, is the trainer's
footprint: an estimate from parameter counts missed the activations of a full row, the logit chunks, compiled
kernels' workspaces and the allocator's slack, and the spec's quick start ran out of memory at its first step. The
warm-up is also the first call of the compiled layers, so the compiling is done before the first real step.

vLLM's share of a shared GPU is a launch flag: a vLLM beside the trainer launches after the warm-up measured (an
eager step when the layers compile, then the compiling step while vLLM boots: trainer/loop.py). It must not boot
beside a warm-up that grows: while vLLM profiles its memory it counts every other allocation on the GPU as its own.
The figure goes to the waiting vLLM's launch, which adds it to the run's plan.json as the plan's measured stage with
the command it gives (plan/assemble.py::measured), and is kept per shape (asyncrl/footprint.py) for the next run of
the shape (whose vLLM then boots beside the warm-up) and ``asyncrl config --server-command``.

One warm-up is too slow to wait for: a gated-DeltaNet model's first, where fla's Triton kernels compile and autotune
(248 s at the Qwen3.5-2B shape on a fresh machine, before vLLM's own ~230 s boot could start). There the trainer
holds its room first (``held_room``, ``hold``: all the GPU but a conservative share for vLLM, reserved in the caching
allocator so that the warm-up grows inside it and the device's free memory stays still), vLLM launches on the rest at
once, and the warm-up measured in that room is kept for the next run.
"""

from __future__ import annotations

import logging
import random
from collections import defaultdict
from typing import TYPE_CHECKING, Any

import torch

from asyncrl.config.schema import Config
from asyncrl.footprint import GIB, TrainerMemory
from asyncrl.rollout.types import RolloutSample, TrainingSequence

if TYPE_CHECKING:
    from asyncrl.packing import RowFactory
    from asyncrl.packing.row import PackedRow

log = logging.getLogger(__name__)

WARM_UP_PROMPT_TOKENS = 64
"""The warm-up groups' prompt length at most: short prompts leave the most trained tokens in a row, the logit
chunks' and the loss's worst case."""
SHORT_ROW_FRACTION = 16
"""The warm-up's second row holds at most this fraction of the token budget, like a step's last, partly filled row,
so that a graph Inductor guards by the row length it saw compiles in the warm-up, not mid-run. Its mix-order
reduction did (``5120 <= hidden_states.size()[1]`` at the Qwen3-4B shape, ~24 s mid-run, RESULTS.md ninth pass), in
more ranges than two rows cover (four at the Qwen3-0.6B shape): trainer/compile_options.py removes those guards, and
this row compiles whatever other guard a short row fails."""


COLD_AUTOTUNE_CONTEXT_BYTES = 6 * GIB
"""What a gated-DeltaNet model's first warm-up adds to the trainer's footprint outside the caching allocator, while
fla's kernels compile and autotune: the device reported 6.2 GiB beyond the allocator after it at the 2B shape cold
(H100 and H200), 0.8 GiB warm (RESULTS.md, sessions 18 and 25). A held room counts it in."""
HOLD_SLACK_BYTES = GIB
"""Left out of the held block: allocations under 1 MiB take segments of their own (the allocator's small pool)."""
STATIC_HEADROOM = 2
"""A room is held only where it holds the trainer's static memory (weights, gradients, two AdamW moments) this many
times over: the 2B shape's warm-up peaked at 26.0 GiB on 20.7 GiB of float32 weights, gradients and moments (1.26x).
The real Qwen3.5-2B (its 248k-token embedding adds ~8 GiB) and Qwen3.5-4B measure first on an 80 GB GPU."""


class TrainerOutOfMemoryError(RuntimeError):
    """CUDA ran out of memory in the trainer; the message says what was measured and which keys change it."""


def room_line(memory: TrainerMemory, free_bytes: int, reserved_bytes: int, share: str | None) -> tuple[str, bool]:
    """Once a server beside the trainer is up: what it holds and what it left the trainer (the device's free memory
    and the trainer's cached blocks), and whether that still holds the measured peak with its margin. A server may
    hold more than its share: vLLM took 1.9 GiB over its --gpu-memory-utilization at the 2B shape, eating the margin
    (RESULTS.md, session 17)."""
    room = free_bytes + reserved_bytes
    server = memory.gpu_bytes - room - memory.context_bytes
    asked = f" ({share})" if share else ""
    line = (f"the server holds {server / GIB:.1f} GiB of the GPU's {memory.gpu_bytes / GIB:.1f}{asked}, leaving the "
            f"trainer {room / GIB:.1f} GiB for its measured peak of {memory.peak_bytes / GIB:.1f} GiB and its margin "
            f"of {(memory.need_bytes - memory.footprint_bytes) / GIB:.1f}")  # fmt: skip
    return line, room >= memory.need_bytes - memory.context_bytes


def synthetic_rows(row_factory: RowFactory, prompt_length: int, completion_length: int, group_size: int,
                   vocab_size: int, top_k: int) -> list[PackedRow]:  # fmt: skip
    """Two rows: one filled to its token budget as a step's rows are, groups of ``group_size`` samples sharing a
    prompt of ``prompt_length`` tokens, each with ``completion_length`` trained tokens (the last sample shortened
    to fill the row); then a short one, part of one group in at most 1/SHORT_ROW_FRACTION of the budget, so that the
    graphs the compiled layers need for short rows compile here too. Random tokens with a fixed seed. Shaped like
    real rows (a tree row's shared prompt and its branches, which start the gated-DeltaNet recurrence from the
    prompt's state), so that the kernels the first real step runs compile and autotune here and the measured peak
    is a real step's: at the 2B shape, after a warm-up on a row of unrelated samples (every segment a root: 26.0
    GiB), the first real step's forward and backward took 132 s and the second ran out of memory with 27.7 GiB
    reserved (RESULTS.md, session 17)."""
    rng = random.Random(0)
    index = 0

    def sample(prompt: list[int], completion: list[int], with_top: bool = False) -> RolloutSample:
        tokens = prompt + completion
        top = [{rng.randrange(vocab_size): -1.0 for _ in range(top_k)} for _ in tokens] if with_top and top_k else None
        sequence = TrainingSequence(tokens, [0] * len(prompt) + [1] * len(completion), [-1.0] * len(tokens), top)
        return RolloutSample(sequence, 1.0 if index % 2 else -1.0, 0.0, index // group_size, index, index, 0,
                             f"warm-up-{index}")  # fmt: skip

    def random_tokens(length: int) -> list[int]:
        return [rng.randrange(vocab_size) for _ in range(length)]

    def full_row() -> PackedRow:
        nonlocal index
        row = row_factory()
        while True:
            prompt = random_tokens(prompt_length)
            for _ in range(group_size):
                completion = random_tokens(completion_length)
                if not row.fits(sample(prompt, completion)):
                    longest, beyond = 0, completion_length  # the longest shortened completion that fits: a bisection
                    while beyond - longest > 1:
                        middle = (longest + beyond) // 2
                        if row.fits(sample(prompt, completion[:middle])):
                            longest = middle
                        else:
                            beyond = middle
                    if longest:
                        row.add(sample(prompt, completion[:longest], with_top=True))
                        index += 1
                    return row.pack(top_k)
                row.add(sample(prompt, completion, with_top=True))
                index += 1

    full = full_row()
    limit = full.num_forwarded // SHORT_ROW_FRACTION
    short, prompt = row_factory(), random_tokens(min(prompt_length, limit // 4))
    index = -(-index // group_size) * group_size  # a group of its own
    for _ in range(group_size):
        candidate = sample(prompt, random_tokens(max(1, limit // (2 * group_size))), with_top=True)
        if not prompt or short.num_tokens + len(candidate.sequence.token_ids) > limit or not short.fits(candidate):
            break
        short.add(candidate)
        index += 1
    return [full, short.pack(top_k)] if short.samples else [full]


def warm_up(run_step: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """``run_step()`` (forward and backward of the synthetic rows, gradient clipping) then an optimizer step whose
    update is thrown away: gradients zeroed, learning rate 0, on a state of its own (a resumed run's moments are
    set aside and put back), the RNG states restored. What the step allocates (the AdamW moments included) stays in
    the caching allocator for the run. The model is in training mode for it, as in a real step: from_pretrained
    leaves it in eval mode, where transformers skips gradient checkpointing (a footprint without it, and compiled
    graphs that the first real step compiles again)."""
    rng = torch.random.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    rates = [group["lr"] for group in optimizer.param_groups]
    kept, optimizer.state = optimizer.state, defaultdict(dict)
    mode = model.training
    model.train()
    try:
        run_step()
        for param in model.parameters():
            if param.grad is not None:
                param.grad.zero_()
        for group in optimizer.param_groups:
            group["lr"] = 0.0
        optimizer.step()
    finally:
        optimizer.zero_grad(set_to_none=True)
        optimizer.state = kept
        model.train(mode)
        for group, rate in zip(optimizer.param_groups, rates, strict=True):
            group["lr"] = rate
        torch.random.set_rng_state(rng[0])
        if rng[1]:
            torch.cuda.set_rng_state_all(rng[1])


def held_room(gpu_bytes: int, context_bytes: int, static_bytes: int) -> TrainerMemory | None:
    """The room the trainer holds for a warm-up vLLM boots beside (its share not yet measured): all the GPU but
    SHARED_GPU_SHARE for vLLM and vLLM's CUDA context, COLD_AUTOTUNE_CONTEXT_BYTES of it outside the allocator. None
    where it holds the trainer's ``static_bytes`` less than STATIC_HEADROOM times: a large trainer measures first,
    and vLLM gets what it leaves."""
    from asyncrl.serving.vllm import SHARED_GPU_SHARE, VLLM_CONTEXT_BYTES

    need = int(gpu_bytes * (1 - SHARED_GPU_SHARE)) - VLLM_CONTEXT_BYTES
    context = context_bytes + COLD_AUTOTUNE_CONTEXT_BYTES
    if static_bytes * STATIC_HEADROOM > need - context:
        return None
    return TrainerMemory.with_need(need, context, gpu_bytes)


def hold(room: TrainerMemory) -> None:
    """Reserve the held room in the caching allocator (one block, freed at once and kept cached), so the warm-up
    allocates inside it and the device's free memory stays still while vLLM profiles its own. Where the GPU no
    longer has it free (another process took some since), a warning: vLLM then counts the warm-up's growth as its
    own and keeps a smaller KV cache."""
    block = room.need_bytes - room.context_bytes - int(torch.cuda.memory_reserved()) - HOLD_SLACK_BYTES
    if block <= 0:
        return
    try:
        torch.empty(block, dtype=torch.uint8, device=torch.device("cuda", torch.cuda.current_device()))
    except torch.OutOfMemoryError:
        log.warning("could not hold %.1f GiB for the trainer's warm-up (%.1f GiB free): vLLM starts beside it and "
                    "counts what it grows by as its own", block / GIB, torch.cuda.mem_get_info()[0] / GIB)  # fmt: skip


def measure(run_step: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer, alone: bool,
            known: TrainerMemory | None) -> TrainerMemory:  # fmt: skip
    """The warm-up's footprint on this process's GPU. ``alone``: nothing else uses the GPU yet, so what the device
    reports in use beyond the allocator is this process's context; otherwise the known figure's context is kept.
    The peak is what the allocator reserved, or, in a held room (where that is the room), what it allocated."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    warm_up(run_step, model, optimizer)
    torch.cuda.synchronize()
    held = known is not None and known.held
    peak = int(torch.cuda.max_memory_allocated() if held else torch.cuda.max_memory_reserved())
    free, total = torch.cuda.mem_get_info()
    if alone or known is None:
        context = max(int(total - free) - int(torch.cuda.memory_reserved()), 0)
    else:
        context = known.context_bytes
    return TrainerMemory(peak, context, int(total))


def out_of_memory_line(config: Config, memory: TrainerMemory | None, share: str | None) -> str:
    """The one line a CUDA out-of-memory error in the trainer ends the run with: what was measured, how the GPU was
    split, and the keys that change it."""
    measured = memory.describe() if memory is not None else "no warm-up measurement (trainer.warm_up or no CUDA)"
    split = f"; vLLM was given {share}" if share else ""
    return (
        f"the trainer ran out of GPU memory ({measured}{split}): lower packing.token_budget, keep "
        f"trainer.gradient_checkpointing=true (now {str(config.trainer.gradient_checkpointing).lower()}), lower "
        "trainer.logit_chunk_tokens, or give the server less with server.gpu_memory_utilization"
    )
