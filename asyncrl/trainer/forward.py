"""The packed forward: per-token log-probabilities of the trained tokens of one row.

Attention follows the row's segments through a tree attention backend (packing/attention.py). The model is
called whole, so whatever wraps it (accelerate's autocast, DDP, peft) still applies, with ``logits_to_keep``
= the positions that predict a trained token; a hook on the LM head takes the hidden states it is handed and
gives it none, and trainer/token_logprobs.py turns them into log-probabilities a chunk of tokens at a time:
scaled by the sampling temperature and, when the sampler drew from a truncated candidate set
(top-k/top-p/min-p), renormalised over that set as the sampler's processed logprobs were.
"""

from __future__ import annotations

import functools
import logging
import os
import sysconfig
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import CodeType
from typing import TYPE_CHECKING, Any

import torch

from asyncrl.config.schema import Config
from asyncrl.packing.attention import RowPlans, attach_tree_attention, attention_windows, unwrap_model
from asyncrl.packing.deltanet import PLAN_KEYWORD, build_recurrent_plan, conv_kernel_size, deltanet_layers
from asyncrl.packing.images import image_features, image_inputs
from asyncrl.packing.row import PackedRow
from asyncrl.trainer import compile_options
from asyncrl.trainer.token_logprobs import compute_token_logprobs

if TYPE_CHECKING:
    from torch._dynamo.callback import CallbackArgs

log = logging.getLogger(__name__)

_COMPILED = "_asyncrl_layers_compiled"
_LOGIT_TRANSFORMS = ("logits_scaling", "logit_scale")
"""Config fields of models that change the LM head's output after it (Granite, Cohere); Gemma's
final_logit_softcapping is applied (trainer/token_logprobs.py)."""


@dataclass
class ForwardOutput:
    logprobs: torch.Tensor  # [T]
    top_logprobs: torch.Tensor | None  # [T, K] for the sampler's top-K ids
    entropy: torch.Tensor  # [T], no grad
    seconds: float
    aux_loss: torch.Tensor | None = None
    """The MoE router's load-balancing loss over the row's forwarded tokens (trainer/moe.py), when asked for."""


def trainer_forward(model: torch.nn.Module, row: PackedRow, config: Config, router_aux: bool = False) -> ForwardOutput:
    """``packed_forward`` as the trainer runs it: the sampling temperature and the trainer's forward settings."""
    t = config.trainer
    return packed_forward(model, row, config.sampling.temperature, attention=t.attention,
                          logit_chunk_tokens=t.logit_chunk_tokens, compile_layers=t.compile_layers,
                          router_aux=router_aux)  # fmt: skip


def packed_forward(
    model: torch.nn.Module,
    row: PackedRow,
    temperature: float,
    *,
    attention: str = "auto",
    logit_chunk_tokens: int | None = None,
    compile_layers: bool | str = False,
    router_aux: bool = False,
) -> ForwardOutput:
    """``attention``: the tree attention backend, ``compile_layers``: torch.compile the decoder layers and the
    log-probability epilogues (see resolve_compile), both trainer settings; ``logit_chunk_tokens``:
    trained tokens whose logits exist at once (0 = all, None = a 1 GiB chunk's), trainer.logit_chunk_tokens;
    ``router_aux``: also return an MoE model's load-balancing loss."""
    device = next(model.parameters()).device
    started = time.perf_counter()
    attach_tree_attention(model)
    backend = resolve_compile(compile_layers, device)
    if backend is not None:
        compile_decoder_layers(model, backend)
        compile_watch().row()
    inner = unwrap_model(model)
    check_head(inner.config)
    softcap = final_softcap(inner.config)
    head = inner.get_output_embeddings()
    extra = {"output_router_logits": True} if router_aux else {}
    with _head_input(head) as captured, image_features(inner, row, device):
        output = model(
            **row_inputs(inner, row, device),
            logits_to_keep=row.token_index.to(device),
            use_cache=False,
            tree_plan=RowPlans.build(attention, row, device, attention_windows(inner)),
            **recurrent_kwargs(inner, row, device),
            **extra,
        )
    out = compute_token_logprobs(
        captured["hidden"][0],
        head,
        row.target_ids.to(device),
        temperature,
        top_ids=row.top_ids,
        sampling_masks=row.sampling_masks,
        chunk_tokens=logit_chunk_tokens,
        compute_dtype=captured["dtype"],
        compile_backend=backend,
        softcap=softcap,
    )
    aux_loss = output.aux_loss if router_aux else None
    return ForwardOutput(out.logprobs, out.top_logprobs, out.entropy, time.perf_counter() - started, aux_loss)


def row_inputs(model: torch.nn.Module, row: PackedRow, device: torch.device) -> dict[str, torch.Tensor]:
    """The row's tokens and positions; for a row with images, M-RoPE position ids (packing/images.py)."""
    if row.images is not None:
        return image_inputs(model, row, device)
    return {"input_ids": row.input_ids[None].to(device), "position_ids": row.position_ids[None].to(device)}


def recurrent_kwargs(model: torch.nn.Module, row: PackedRow, device: torch.device) -> dict:
    """The row's plan for the gated-DeltaNet layers of a hybrid model (packing/deltanet.py); none for others."""
    if not deltanet_layers(model):
        return {}
    return {PLAN_KEYWORD: build_recurrent_plan(row, conv_kernel_size(model), device)}


def check_head(config: object) -> None:
    """The log-probabilities are computed from the LM head's input: refuse models that transform its output
    (other than by final_softcap)."""
    found = {key: getattr(config, key) for key in _LOGIT_TRANSFORMS if getattr(config, key, None) not in (None, 1.0)}
    if found:
        raise ValueError(
            f"packed_forward: {type(config).__name__} transforms the LM head's logits ({found}), which "
            "the chunked log-probabilities (trainer/token_logprobs.py) do not apply"
        )


def final_softcap(config: Any) -> float | None:
    """Gemma's cap on the LM head's logits (cap * tanh(logits / cap)), which its forward applies after the head:
    its text config's final_logit_softcapping (None for Gemma 3's checkpoints, 30 for Gemma 2's)."""
    return getattr(config.get_text_config(), "final_logit_softcapping", None)


@contextmanager
def _head_input(head: torch.nn.Module) -> Iterator[dict]:
    """Capture the LM head's input (the kept positions' final hidden states) and the autocast dtype it would
    have computed in, and hand the head an empty slice instead, so no [tokens x vocabulary] logits are built."""
    captured: dict = {}

    def hook(module: torch.nn.Module, args: tuple) -> tuple:
        hidden = args[0]
        device_type = hidden.device.type
        autocast = torch.is_autocast_enabled(device_type)
        captured["hidden"] = hidden
        captured["dtype"] = torch.get_autocast_dtype(device_type) if autocast else None
        return (hidden[..., :0, :], *args[1:])

    handle = head.register_forward_pre_hook(hook)
    try:
        yield captured
    finally:
        handle.remove()
    if "hidden" not in captured:
        raise RuntimeError(f"packed_forward: the model never called its output embedding {type(head).__name__}")


def resolve_compile(compile_layers: bool | str, device: torch.device) -> str | None:
    """``trainer.compile_layers`` as a torch.compile backend (None = eager): true = inductor, auto = inductor on
    CUDA, or a backend's name (aot_eager traces as inductor does, without code generation). The config's string
    field holds a YAML boolean as "True"/"False"."""
    if compile_layers == "auto":
        return "inductor" if device.type == "cuda" else None
    flag = {"true": True, "false": False}.get(str(compile_layers).lower())
    if flag is not None:
        return "inductor" if flag else None
    from torch._dynamo import list_backends

    if compile_layers not in list_backends(exclude_tags=()):
        raise ValueError(
            f"trainer.compile_layers={compile_layers!r} must be true, false, auto or a torch.compile "
            f"backend ({', '.join(list_backends())})"
        )
    return compile_layers


@dataclass
class CompileWatch:
    """Names in the run's log what torch.compile does once the first row is trained, where it should do nothing:
    each recompile with the guard that failed, and each compile after the first row with its trigger (a frame,
    a lazily compiled backward, a CUDA graph recording) and seconds. Such a compile costs a GPU step 10-30 s and
    is otherwise silent."""

    rows: int = 0
    started: float = 0.0
    site: str = ""
    """Where the compile in progress was reached: the innermost frame outside torch."""
    reported: dict[CodeType, int] = field(default_factory=dict)
    """Guard failures already logged, per compiled code object."""

    def start(self, args: CallbackArgs) -> None:
        self.started, self.site = time.perf_counter(), _outside_torch(traceback.extract_stack()[:-1])

    def end(self, args: CallbackArgs) -> None:
        if self.rows > 1:
            log.info("torch.compile: %.1f s compiling (%s, compile id %s, from %s) during row %d",
                        time.perf_counter() - self.started, args.callback_trigger.name.lower(), args.compile_id,
                        self.site, self.rows)  # fmt: skip

    def row(self) -> None:
        """A row is about to be forwarded: log the recompiles of the last one (its forward and backward), naming
        that row: logged as the next row starts, a warm-up's recompiles read as the first real step's otherwise."""
        self.report()
        self.rows += 1

    def report(self) -> None:
        """Log the recompiles not logged yet as the current row's (the run's last row has no next row)."""
        from torch._dynamo.utils import guard_failures

        for code, reasons in list(guard_failures.items()):
            seen = self.reported.get(code, 0)
            for reason in reasons[seen if seen <= len(reasons) else 0 :]:  # dynamo's reset() empties the lists
                log.info("torch.compile compiled %s (%s:%d) again during row %d: %s", code.co_name, code.co_filename,
                         code.co_firstlineno, self.rows, " ".join(reason.split("\nUser stack")[0].split()))  # fmt: skip
            self.reported[code] = len(reasons)


def _outside_torch(stack: traceback.StackSummary) -> str:
    """The innermost frame of ``stack`` that is neither torch's nor the standard library's (which torch.compile
    passes through), as file:line in function."""
    paths = sysconfig.get_paths()

    def ours(filename: str) -> bool:
        stdlib = filename.startswith(paths["stdlib"]) and not filename.startswith(paths["purelib"])
        return not (stdlib or filename.startswith(os.path.dirname(torch.__file__)))

    frame = next((f for f in reversed(stack) if ours(f.filename)), stack[-1])
    return f"{frame.filename}:{frame.lineno} in {frame.name}"


@functools.cache
def compile_watch() -> CompileWatch:
    """The process's CompileWatch, told of every compilation by torch.compile's callbacks."""
    from torch._dynamo.callback import callback_handler

    watch = CompileWatch()
    callback_handler.register_start_callback(watch.start)
    callback_handler.register_end_callback(watch.end)
    return watch


def report_last_row() -> None:
    """At the trainer's close: the last row's recompiles, where any row was compiled."""
    if compile_watch.cache_info().currsize:
        compile_watch().report()


def compile_decoder_layers(model: torch.nn.Module, backend: str) -> None:
    """torch.compile each decoder layer once, for any row length (idempotent). The tree attention call is
    excluded (packing/attention.py), so each layer compiles to the fused norms, RoPE, projections, SwiGLU and
    residuals around one eager attention call. Gradient checkpointing is turned on before (trainer/model.py), so
    a layer that checkpoints its ``forward`` gets its checkpoint function wrapped here (_checkpoints_forward)."""
    inner = unwrap_model(model)
    if getattr(inner, _COMPILED, False):
        return
    layers = getattr(inner.get_decoder(), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError(f"trainer.compile_layers: {type(inner).__name__}'s decoder has no `layers` list to compile")
    options = compile_options.inductor_options(backend)
    checkpointed = torch.compile(_call, dynamic=True, backend=backend, options=options)
    for layer in layers:
        layer.compile(dynamic=True, backend=backend, options=options)
        if _checkpoints_forward(layer) and hasattr(layer, "_gradient_checkpointing_func"):
            layer._gradient_checkpointing_func = _through(layer._gradient_checkpointing_func, checkpointed)
    setattr(inner, _COMPILED, True)


def _checkpoints_forward(layer: torch.nn.Module) -> bool:
    """transformers >= 5.24 checkpoints a layer's ``forward`` (not its ``__call__``, as 5.17 did, which the
    compiled call then runs inside): the checkpoint disables torch.compile, so the compiled ``__call__`` runs the
    whole layer eagerly (~30% of the trainer's GPU speed) unless the function it checkpoints is compiled itself."""
    code = getattr(type(layer).forward, "__code__", None)
    return code is not None and code.co_name == "forward_with_checkpointing"


def _through(checkpoint: Callable, compiled: Callable) -> Callable:
    """``checkpoint`` (a layer's ``_gradient_checkpointing_func``) running the function it is handed through the
    compiled pass-through ``compiled``, in the forward and in the backward's recomputation."""

    def run(function: Callable, *args: object) -> object:
        return checkpoint(functools.partial(compiled, function), *args)

    return run


def _call(function: Callable, *args: object) -> object:
    """Calls ``function``: compiled once, it compiles whatever function a checkpoint hands it."""
    return function(*args)
