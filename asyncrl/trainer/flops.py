"""Model FLOPs of a packed row and the training device's peak: the spec's ``perf/fwd_bwd_mfu`` and
``perf/wall_clock_mfu``.

FLOPs are counted from the model config, not measured: a forward is 2 FLOPs per multiply-add of every linear
layer at every forwarded token, attention's score and value products over the causal query-key pairs a row really
needs (a tree row's shared prefix is attended once; a sliding-window layer's at most its window a query), a
gated-DeltaNet layer's state update (4 FLOPs per state cell per token), and the LM head at the positions whose
logits are computed (those that train a token); fwd+bwd is 3x the forward. Embedding lookups, norms and
activations are left out. A Mixture-of-Experts layer counts its router and the experts each token is routed to
(``num_experts_per_tok``), not all experts.

The peak comes from ``trainer.peak_tflops`` or a table of datasheet dense figures (no sparsity) per GPU model and
precision; where neither knows the device (a CPU, an unlisted GPU) MFU is omitted, as the spec says.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from asyncrl.config.schema import Config, ModelDtype
from asyncrl.packing.row import PackedRow
from asyncrl.trainer.model import mixed_precision_dtype

log = logging.getLogger(__name__)

PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989.5, "fp32": 66.9},
    "H100": {"bf16": 989.5, "fp32": 66.9},  # SXM; the PCIe card is listed below and matched first
    "H100 PCIe": {"bf16": 756.5, "fp32": 51.2},
    "H20": {"bf16": 148.0, "fp32": 44.0},
    "GH200": {"bf16": 989.5, "fp32": 66.9},
    "B200": {"bf16": 2250.0, "fp32": 80.0},
    "A100": {"bf16": 312.0, "fp32": 19.5},
    "A10G": {"bf16": 70.0, "fp32": 31.2},
    "L40S": {"bf16": 362.1, "fp32": 91.6},
    "L4": {"bf16": 121.0, "fp32": 30.3},
}  # fmt: skip
"""Dense tensor-core TFLOP/s per GPU (NVIDIA datasheets), bf16 and plain fp32; keys are matched against
``torch.cuda.get_device_name`` longest first."""

SUPPORTED_TYPES = (
    "llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe", "qwen3_next", "qwen2_5_vl_text",
    "qwen3_vl_text", "qwen3_vl_moe_text", "qwen3_5_text", "qwen3_5_moe_text", "gemma3_text",
)  # fmt: skip
"""Text model types whose layers ``forward_flops`` knows (the config's ``get_text_config().model_type``)."""


def peak_tflops(device: torch.device, precision: str) -> float | None:
    """The datasheet peak of ``device`` at ``precision`` (bf16 | fp32), or None for a CPU or an unlisted GPU."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key in sorted(PEAK_TFLOPS, key=len, reverse=True):
        if key in name:
            return PEAK_TFLOPS[key][precision]
    return None


def _mlp(text: Any) -> int:
    """Multiply-adds of one token through an MLP block: the routed experts and router of an MoE, else the dense MLP."""
    d = text.hidden_size
    experts = getattr(text, "num_experts", None) or 0
    if experts and getattr(text, "moe_intermediate_size", None):
        routed = 3 * d * text.moe_intermediate_size * text.num_experts_per_tok + d * experts
        shared = getattr(text, "shared_expert_intermediate_size", None) or 0
        return routed + 3 * d * shared + (d if shared else 0)
    return 3 * d * text.intermediate_size


def forward_flops(model_config: Any, tokens: int, logits: int, pairs: int, window_pairs: int | None = None) -> float:
    """Forward FLOPs of ``tokens`` forwarded tokens, ``logits`` LM-head positions and ``pairs`` causal attention
    query-key pairs per full-attention layer (``window_pairs`` per sliding-window layer; default ``pairs``) (module
    docstring)."""
    text = model_config.get_text_config()
    d, heads, kv = text.hidden_size, text.num_attention_heads, text.num_key_value_heads
    head_dim = getattr(text, "head_dim", None) or d // heads
    types = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    full, sliding = types.count("full_attention"), types.count("sliding_attention")
    attention_layers = full + sliding
    gated = 2 if text.model_type.startswith(("qwen3_5", "qwen3_next")) else 1  # q_proj also projects an output gate
    mlp = _mlp(text)
    attention = d * heads * head_dim * (1 + gated) + 2 * d * kv * head_dim
    scores = full * pairs + sliding * (pairs if window_pairs is None else window_pairs)
    flops = 2 * (attention + mlp) * attention_layers * tokens + 4 * heads * head_dim * scores
    linear_layers = len(types) - attention_layers
    if linear_layers:
        key = text.linear_num_key_heads * text.linear_key_head_dim
        value = text.linear_num_value_heads * text.linear_value_head_dim
        projections = d * (2 * key + value) + d * value + 2 * d * text.linear_num_value_heads + value * d
        state = 4 * text.linear_num_value_heads * text.linear_key_head_dim * text.linear_value_head_dim
        flops += (2 * (projections + mlp) + state) * linear_layers * tokens
    return flops + 2 * d * text.vocab_size * logits


def row_pairs(row: PackedRow, window: int | None = None) -> int:
    """Causal (bottom-right) query-key pairs of a row's segments: the attention work a row really needs; with a
    ``window``, each query's keys at most that many (its own included), as a sliding-window layer attends."""
    total = 0
    for seg in row.segments:
        n_q, n_kv = seg.q_end - seg.q_start, int(seg.kv_index.numel())
        before = n_kv - n_q  # keys every query of the segment sees before the first query's own
        within = n_q if window is None else min(max(window - before, 0), n_q)  # queries whose keys fit the window
        total += within * before + within * (within + 1) // 2 + (n_q - within) * (window or 0)
    return total


def row_flops(model_config: Any, row: PackedRow) -> float:
    """fwd+bwd FLOPs of one packed row (3x its forward); logits count at the positions that train a token."""
    logits = int(row.token_index.unique().numel())
    window = getattr(model_config.get_text_config(), "sliding_window", None)
    return 3.0 * forward_flops(model_config, row.num_forwarded, logits, row_pairs(row), row_pairs(row, window))


@dataclass(frozen=True)
class MfuMeter:
    """Turns a step's rows and seconds into MFU over all training devices (``peak_flops``: their summed peak)."""

    model_config: Any
    peak_flops: float

    @classmethod
    def for_run(cls, model_config: Any, peak: float | None, device: torch.device, precision: str,
                devices: int) -> MfuMeter | None:  # fmt: skip
        """None, with one log line saying why, when the architecture or the device's peak is unknown."""
        model_type = model_config.get_text_config().model_type
        if model_type not in SUPPORTED_TYPES:
            log.info("MFU not logged: FLOPs of model type %s are not counted (known: %s)", model_type,
                     ", ".join(SUPPORTED_TYPES))  # fmt: skip
            return None
        peak = peak if peak is not None else peak_tflops(device, precision)
        if peak is None:
            log.info("MFU not logged: the peak of %s at %s is unknown (set trainer.peak_tflops)", device, precision)
            return None
        return cls(model_config, peak * 1e12 * devices)

    def flops(self, rows: list[PackedRow]) -> float:
        return sum(row_flops(self.model_config, row) for row in rows)

    def mfu(self, flops: float, seconds: float) -> float:
        return flops / max(seconds, 1e-9) / self.peak_flops


def mfu_meter(config: Config, model_config: Any, devices: int) -> MfuMeter | None:
    """The run's meter: the current CUDA device (else the CPU: none), the bf16 peak when the step computes in 16 bits
    (fp16's dense tensor-core peak is bf16's on the GPUs listed)."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    half = mixed_precision_dtype(config) is not None or config.model.dtype in (ModelDtype.bfloat16, ModelDtype.float16)
    return MfuMeter.for_run(model_config, config.trainer.peak_tflops, device, "bf16" if half else "fp32", devices)
