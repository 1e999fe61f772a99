"""FSDP2 for the trainer at every world size: shard the model, gather it for weight sync, checkpoint it.

One trainer process is a world of one (trainer/ranks.py) and runs this same code: one forward/backward, one
checkpoint format, whatever the rank count. Raw ``fully_shard`` rather than accelerate's FSDP2 plugin: the plugin
owns the process group and the launch (``accelerate launch``), while asyncrl's rank 0 drives its followers with
its own commands (trainer/distributed.py), gathers buckets for weight sync on demand and checkpoints with
torch.distributed.checkpoint directly; the plugin would wrap the same ``fully_shard`` call. Sharding a world of
one costs 3-10% on a CPU: the embedded model's fwd+bwd+step of a 1024-token row took 0.68-0.81 s sharded against
0.66-0.75 s plain on one thread, 0.44 against 0.40 s on two, 4.65 against 4.48 s for 4096 tokens
(``python benchmarks/single_rank.py``, five runs on a 2-core machine); the GPU figure is for the next H200 session.

Each decoder layer (the model's ``_no_split_modules`` classes) and the root are ``fully_shard``ed. On GPU the
master weights are fp32 and forward/backward run in bf16 (fp16 with trainer.fp16, its loss scaled) with fp32
gradient reduction (MixedPrecisionPolicy); on CPU everything stays float32. With model.cast_lm_head_to_fp32 the LM
head is a unit of its own that computes in float32. FSDP averages gradients over the ranks (gloo cannot sum with a
pre-scale), so each rank's loss is multiplied by the number of ranks (trainer/distributed.py::train_rows).

A checkpoint's ``sharded/`` files are torch.distributed.checkpoint's, which record each tensor's global shape:
they load on any number of ranks. With LoRA they hold the adapter and its optimizer state only, and the
consolidated copy is the adapter's files (peft's format), whose base resume loads from model.name_or_path.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from asyncrl import lora
from asyncrl.config.schema import Config
from asyncrl.interrupts import interrupts_deferred
from asyncrl.safetensors_files import save_safetensors
from asyncrl.trainer.checkpoint import SHARDED_DIR
from asyncrl.trainer.ranks import Ranks

log = logging.getLogger(__name__)


def shard(model: torch.nn.Module, config: Config, param_dtype: torch.dtype | None) -> torch.nn.Module:
    """``fully_shard`` each decoder layer, then the root; the model is changed in place and returned. A model
    that names no decoder layer class is sharded as one unit (gathered whole for each forward). ``param_dtype``:
    the mixed-precision dtype forward and backward run in (model.py's mixed_precision_dtype); None: as loaded."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kwargs: dict[str, Any] = {}
    if param_dtype is not None:  # fp32 master weights and optimizer state whatever model.dtype loaded, for what
        for param in model.parameters():  # trains: a frozen LoRA base or vision tower stays as loaded (half the memory)
            if param.requires_grad:
                param.data = param.data.float()
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    if config.trainer.fsdp_cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    elif torch.cuda.is_available():
        model.to(torch.device("cuda", torch.cuda.current_device()))
    layer_classes = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in layer_classes]
    if not layers:
        log.warning("%s names no decoder layer class (_no_split_modules): sharded as one unit", type(model).__name__)
    for layer in layers:
        fully_shard(layer, **kwargs)
    if config.model.cast_lm_head_to_fp32:
        fully_shard(model.get_output_embeddings(), **float32_head(kwargs))
    fully_shard(model, **kwargs)
    return model


def float32_head(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``fully_shard``'s arguments for the LM head as a unit of its own under model.cast_lm_head_to_fp32: inside the
    root it would be gathered in the root's mixed-precision dtype (bfloat16), so it gets a float32 policy, which also
    casts its input up. Not resharded after the forward: trainer/forward.py reads its weight after the model returns
    (the head's own forward sees an empty slice), as it reads the root's."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    return {**kwargs, "mp_policy": policy, "reshard_after_forward": False}


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Clip the step's gradient to ``max_norm``; its norm before clipping, whole on every rank (a collective)."""
    return _full(torch.nn.utils.clip_grad_norm_(list(model.parameters()), max_norm))


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A sharded tensor gathered whole on every rank (a collective); a plain tensor as is."""
    full_tensor = getattr(tensor, "full_tensor", None)
    return full_tensor() if full_tensor is not None else tensor


def synced_parameters(model: torch.nn.Module, trainable_only: bool) -> list[tuple[str, torch.Tensor]]:
    """The parameters a sync gathers, in the same order on every rank: all of them, or (an adapter sync) the
    trainable ones only."""
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad or not trainable_only]


BUCKET_BYTES = 256 << 20
"""Serving-dtype bytes gathered per all-gather: few collectives (one per parameter is latency-bound: ~0.3 s a
sync for Qwen3-0.6B on 2 H200s) and a bounded extra memory, never the whole model."""
SAVE_THREADS = 8
"""Writer threads of a checkpoint's resume files (each writes a file of its own; torch.distributed.checkpoint's
default is one, which leaves the disk idle while it serializes). A whole save of Gemma-3-270M's shape (3.9 GB of fp32
weights and AdamW state, then the bf16 model), `benchmarks/save_cost.py`, medians: on an H100 machine 6.4 s with one
thread (5.1-9.6 over six saves), 4.5 s with 8 (4.2-4.6); on a 2-core CPU machine 11.8 s and 8.0 s."""


def buckets(params: list[torch.Tensor], dtype: torch.dtype | None, limit: int = BUCKET_BYTES) -> list[range]:
    """Consecutive parameter indices of one gathered dtype and at most ``limit`` bytes (a larger parameter alone)."""
    out: list[range] = []
    start, size, kind = 0, 0, None
    for index, param in enumerate(params):
        target = _target_dtype(param, dtype)
        nbytes = param.numel() * target.itemsize
        if index > start and (size + nbytes > limit or target != kind):
            out.append(range(start, index))
            start, size = index, 0
        size, kind = size + nbytes, target
    if start < len(params):
        out.append(range(start, len(params)))
    return out


def gather_bucket(params: list[torch.Tensor], dtype: torch.dtype | None) -> list[torch.Tensor]:
    """The bucket's parameters whole on every rank, in the serving dtype, with one all-gather; finished before
    anyone reads them.

    FSDP2 shards dim 0 as ``torch.chunk`` does: rank r holds rows [r*c, (r+1)*c) with c = ceil(rows / ranks),
    the last ranks fewer or none. Each rank sends its shards padded to c rows, concatenated, so the gathered
    buffer is [ranks, sum of padded shards] and each parameter is its column block, rows trimmed. The all-gather
    runs on the communication stream and the result may be read from another stream or thread (vLLM's NCCL
    broadcast, CUDA IPC): waiting here means no gather is ever queued behind a transfer that waits for it, the
    FSDP-rank deadlock of TRL #6797/#7103."""
    import torch.distributed as dist

    if not params or not all(hasattr(p, "to_local") for p in params):
        return [_cast(_full(p.detach()), dtype) for p in params]
    group = params[0].device_mesh.get_group()
    world = dist.get_world_size(group)
    if world == 1:  # a world of one holds every parameter whole: no buffer, no collective, one cast each
        return [_cast(p.to_local().detach(), dtype) for p in params]
    target = _target_dtype(params[0], dtype)
    chunks = [-(-p.shape[0] // world) for p in params]
    widths = [c * p[0].numel() if p.shape[0] else 0 for c, p in zip(chunks, params, strict=True)]
    local = params[0].to_local()
    mine = torch.zeros(sum(widths), dtype=target, device=local.device)
    offset = 0
    for param, width in zip(params, widths, strict=True):
        shard = param.to_local().detach().reshape(-1)
        mine[offset : offset + shard.numel()] = shard
        offset += width
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    stacked = torch.stack(everyone)
    out, offset = [], 0
    for param, chunk, width in zip(params, chunks, widths, strict=True):
        block = stacked[:, offset : offset + width].reshape(world * chunk, *param.shape[1:])
        out.append(block[: param.shape[0]])
        offset += width
    if stacked.is_cuda:
        torch.cuda.current_stream().synchronize()
    return out


def _target_dtype(param: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None and param.is_floating_point() else param.dtype


def _cast(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor


def _buffers(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers a state dict holds (FSDP2 does not shard buffers: every rank has them whole)."""
    persistent = set(model.state_dict().keys())
    return [(name, buffer.detach()) for name, buffer in model.named_buffers() if name in persistent]


class GatheredModel:
    """Rank 0's view of the sharded model for the weight-sync transports: parameters are gathered on every rank
    when the transport reads them (rank 0 announces which bucket, the others ``serve_gathers``), a bucket of
    consecutive parameters per all-gather, never the whole model. Tied weights appear once, under their first
    name. ``trainable_only``: the adapter sync's view, which gathers the adapter and never the frozen base."""

    yields_unique_tensors = True  # each tensor is a fresh gather: its address may repeat, its name does not

    def __init__(
        self, model: torch.nn.Module, ranks: Ranks, dtype: torch.dtype | None, trainable_only: bool = False
    ) -> None:
        self.model, self.ranks, self.dtype, self.trainable_only = model, ranks, dtype, trainable_only
        self.params = synced_parameters(model, trainable_only)
        self.index = {name: i for i, (name, _) in enumerate(self.params)}
        self.buckets = buckets([p for _, p in self.params], dtype)
        self.buffers = _buffers(model)
        self._held: tuple[range, list[torch.Tensor]] = (range(0), [])

    @property
    def config(self) -> Any:
        return self.model.config

    def sharded_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Names, global shapes and dtypes without a gather (the transports' metadata)."""
        return iter(self.params)

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        for index, (name, _) in enumerate(self.params):
            yield name, self.gather(index)

    def state_dict(self) -> Mapping[str, torch.Tensor]:
        return _LazyState(self)

    def full(self, name: str) -> torch.Tensor:
        """Parameter ``name`` whole (a LoRA layer's merge reads its adapter's tensors by name)."""
        return self.gather(self.index[name])

    def gather(self, index: int) -> torch.Tensor:
        """Parameter ``index`` whole; its bucket is gathered once and held until another one is needed."""
        held, tensors = self._held
        if index not in held:
            bucket = next(b for b in self.buckets if index in b)
            self.ranks.announce(bucket.start)
            tensors = gather_bucket([self.params[i][1] for i in bucket], self.dtype)
            self._held = held, _ = bucket, tensors
            held = bucket
        return tensors[index - held.start]

    def done(self) -> None:
        """Release the other ranks from ``serve_gathers``."""
        self._held = (range(0), [])
        self.ranks.announce(-1)


class _LazyState(Mapping[str, torch.Tensor]):
    """A state dict whose parameters are gathered when looked up, in iteration order."""

    def __init__(self, view: GatheredModel) -> None:
        self.view = view
        self.buffers = dict(view.buffers)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.view.index:
            return self.view.full(name)
        return _cast(self.buffers[name], self.view.dtype)

    def __iter__(self) -> Iterator[str]:
        return iter([*self.view.index, *self.buffers])

    def __len__(self) -> int:
        return len(self.view.index) + len(self.buffers)


def serve_gathers(model: torch.nn.Module, ranks: Ranks, dtype: torch.dtype | None, trainable_only: bool) -> None:
    """A follower's side of one weight sync: take part in each bucket's gather rank 0 announces, until done."""
    params = [p for _, p in synced_parameters(model, trainable_only)]
    starts = {bucket.start: bucket for bucket in buckets(params, dtype)}
    while (start := ranks.announce()) >= 0:
        gather_bucket([params[i] for i in starts[start]], dtype)


@interrupts_deferred()
def save_weights(
    directory: Path,
    model: torch.nn.Module,
    optimizer: Any,
    ranks: Ranks,
    dtype: torch.dtype | None,
    *,
    resumable: bool,
    threads: int = SAVE_THREADS,
) -> None:
    """On every rank: the sharded resume files (``resumable``, by ``threads`` writers) and, written by rank 0, a
    consolidated copy: the ``model.safetensors`` in the serving dtype with the model's config, or a peft model's
    adapter files. A stop signal waits for the end (asyncrl/interrupts.py)."""
    import torch.distributed.checkpoint as dcp

    adapter = lora.is_peft(model)
    if resumable:
        writer = dcp.FileSystemWriter(directory / SHARDED_DIR, thread_count=threads)
        dcp.save(_resume_state(model, optimizer), storage_writer=writer)
    named = synced_parameters(model, trainable_only=adapter)
    dtype = None if adapter else dtype  # an adapter is saved as trained, as peft's save_pretrained does
    tensors = {}
    for bucket in buckets([p for _, p in named], dtype):  # every rank gathers, in the same order
        gathered = gather_bucket([named[i][1] for i in bucket], dtype)
        if ranks.rank == 0:
            tensors.update({named[i][0]: full.contiguous().cpu() for i, full in zip(bucket, gathered, strict=True)})
    if ranks.rank != 0:
        return
    directory.mkdir(parents=True, exist_ok=True)
    if adapter:
        lora.save_adapter(model, tensors, directory)
        return
    tensors.update({name: _cast(buffer, dtype).contiguous().cpu() for name, buffer in _buffers(model)})
    save_safetensors(tensors, directory / "model.safetensors")
    model.config.save_pretrained(directory)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(directory)


def _state_options(model: torch.nn.Module) -> Any:
    """A LoRA run's resume files hold the adapter alone: its frozen base is reloaded from model.name_or_path."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    frozen = lora.is_peft(model)
    return StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)


def _resume_state(model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer, options=_state_options(model))
    return {"model": model_state, "optimizer": optim_state}


def load_sharded(directory: Path, model: torch.nn.Module, optimizer: Any) -> None:
    """Restore the fp32 master weights and the optimizer state from a checkpoint's sharded files, resharded for
    this run's ranks."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _resume_state(model, optimizer)
    dcp.load(state, checkpoint_id=str(directory / SHARDED_DIR))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=_state_options(model))  # fmt: skip
