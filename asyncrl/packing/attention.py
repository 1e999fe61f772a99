"""Tree attention: each segment's queries attend to its root-to-segment path, causally (bottom-right aligned).

One function is registered with transformers' `AttentionInterface`, so Qwen3/Llama-family models run
unmodified: `packed_forward` passes a row's plan as the `tree_plan` keyword, which the model hands to every
attention layer. A plan is built once per row by a backend of the `attention` registry: `sdpa` (explicit
mask; CPU and tests), `varlen` (K/V gathered along each segment's path, one varlen flash call per query group;
CUDA), `cascade` (one varlen call per tree depth, no K/V gathered, merged by log-sum-exp: packing/cascade.py;
CUDA), `flex` (FlexAttention block mask from the ancestor relation), `kernels` (FA3 from the Hub, else `varlen`
with one warning) and `auto` (sdpa on CPU, varlen on CUDA).

Sliding-window layers (Gemma 3's `sliding_attention`) get a plan of their own per row (`RowPlans`): a query sees
the keys of its path at most window - 1 positions before it, positions counted per sample (in a tree row a
completion's window reaches back into its shared prompt).
"""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from asyncrl.packing.cascade import (
    CascadeKernel,
    CascadeLayout,
    FlashKernel,
    cascade_attention,
    cascade_layout,
    window_layout,
)
from asyncrl.packing.row import PackedRow, path_keys
from asyncrl.registry import Registry

TREE_ATTENTION = "asyncrl_tree"
FA3_REPO = "kernels-community/vllm-flash-attn3"
FLEX_BUCKET = 1024
"""Flex rows are padded to a multiple of this on CUDA, so compiled kernels are reused across row lengths."""


class TreePlan(Protocol):
    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
        """[1, H, L, D] queries, [1, H_kv, L, D] keys/values -> [1, L, H, D]."""
        ...


PlanFactory = Callable[..., TreePlan]
"""(row, device, window=None) -> the row's plan for layers of that sliding window (None: full attention)."""
VarlenKernel = Callable[..., torch.Tensor]
"""(q [Tq,H,D], k [Tk,Hkv,D], v, cu_q, cu_k, max_q, max_k, scale, window) -> [Tq,H,D], causal bottom-right per
sequence, each query seeing at most window - 1 keys before its own (window None: all)."""

ATTENTION: Registry[PlanFactory] = Registry("attention")


# ---- sdpa: the explicit mask ---------------------------------------------------------------------------------


def tree_attention_mask(row: PackedRow, window: int | None = None) -> torch.Tensor:
    """[1, 1, L, L] boolean mask: each segment's queries see their path's keys, causally (bottom-right), and with
    a sliding window only the keys less than ``window`` positions before them."""
    length = row.num_forwarded
    mask = torch.zeros(length, length, dtype=torch.bool)
    for seg in row.segments:
        n_q, n_kv = seg.q_end - seg.q_start, int(seg.kv_index.numel())
        allowed = torch.ones(n_q, n_kv, dtype=torch.bool).tril(diagonal=n_kv - n_q)
        if window is not None:
            distance = row.position_ids[seg.q_start : seg.q_end, None] - row.position_ids[seg.kv_index][None]
            allowed &= distance < window
        mask[seg.q_start : seg.q_end, seg.kv_index] = allowed
    return mask[None, None]


@dataclass
class MaskPlan:
    mask: torch.Tensor

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
        gqa = query.shape[1] != key.shape[1]
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=self.mask, scale=scale, enable_gqa=gqa)
        return out.transpose(1, 2)


@ATTENTION.register("sdpa")
def sdpa_plan(row: PackedRow, device: torch.device, window: int | None = None) -> MaskPlan:
    return MaskPlan(tree_attention_mask(row, window).to(device))


# ---- varlen: gather each segment's path, one varlen call -------------------------------------------------------


@dataclass
class VarlenPlan:
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    kv_gather: torch.Tensor | None
    """Layout positions of every segment's path, concatenated; None when each path is the segment itself."""
    kernel: VarlenKernel
    half_precision: bool = True
    """The kernel takes fp16/bf16 only (flash); False for a reference kernel that computes in the inputs' dtype."""
    window: int | None = None
    """Sliding window (None: full attention); the gathered paths then hold only the keys the window reaches."""

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
        """Lay out [tokens, heads, dim] in the kernel's dtype, one copy per tensor where the dtype already fits.
        Under autocast the cast comes before the gather, so the float32 keys of Qwen3's q/k norms are copied along
        every path (3x a tree row's tokens), and their gradient summed back, in half precision (about one bf16
        rounding on shared-prompt keys). A float32 model without autocast, chosen for precision, gathers in
        float32 and sums those gradients in float32."""
        dtype, autocast = flash_dtype(query, value) if self.half_precision else (query.dtype, False)
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
        if self.kv_gather is not None:
            if autocast:
                k, v = k.to(dtype), v.to(dtype)
            k, v = k.index_select(0, self.kv_gather), v.index_select(0, self.kv_gather)
        q, k, v = (t.to(dtype, memory_format=torch.contiguous_format).contiguous() for t in (q, k, v))
        out = self.kernel(q, k, v, self.cu_q, self.cu_k, self.max_q, self.max_k, scale, self.window).unsqueeze(0)
        return out if autocast else out.to(query.dtype)  # under autocast the next projection casts to half anyway


def flash_dtype(query: torch.Tensor, value: torch.Tensor) -> tuple[torch.dtype, bool]:
    """The half dtype flash kernels run in, and whether autocast is on. Under autocast Qwen3's q/k norms hand back
    float32 (float32 weight x bf16 activations) beside a bf16 v: autocast's dtype, else a half input's, else
    bfloat16."""
    if torch.is_autocast_enabled(query.device.type):
        return torch.get_autocast_dtype(query.device.type), True
    halves = (t.dtype for t in (query, value) if t.dtype in (torch.float16, torch.bfloat16))
    return next(halves, torch.bfloat16), False


@ATTENTION.register("varlen")
def varlen_plan(
    row: PackedRow,
    device: torch.device,
    kernel: VarlenKernel | None = None,
    half_precision: bool = True,
    window: int | None = None,
) -> VarlenPlan:
    """Queries are the layout itself (segments are contiguous); keys are each segment's path (within the window),
    gathered."""
    if kernel is None:
        _needs_cuda("varlen", device)
        kernel = torch_varlen
    keys = path_keys(row.segments, window)
    return VarlenPlan(
        cu_q=_cumulative(keys.q_lens).to(device),
        cu_k=_cumulative(keys.k_lens).to(device),
        max_q=max(keys.q_lens, default=0),
        max_k=max(keys.k_lens, default=0),
        kv_gather=None if keys.gather is None else keys.gather.to(device),
        kernel=kernel,
        half_precision=half_precision,
        window=window,
    )


def _needs_cuda(attention: str, device: torch.device) -> None:
    if device.type != "cuda":
        raise ValueError(f"attention '{attention}' needs a CUDA device (the model is on {device}); use sdpa or auto")


def _cumulative(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)


def torch_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale, window=None):  # type: ignore[no-untyped-def]
    """torch.nn.attention.varlen.varlen_attn, whichever of its signatures this torch has."""
    from torch.nn.attention.varlen import varlen_attn

    params = _varlen_params()
    if window is not None and "window_size" not in params:
        raise ValueError("this torch's varlen_attn has no window_size for sliding-window layers; use cascade or flex")
    left = -1 if window is None else window - 1
    kwargs: dict[str, Any] = {"window_size": (left, 0)} if "window_size" in params else {"is_causal": True}
    if "scale" in params:
        kwargs["scale"] = scale
    elif abs(scale - q.shape[-1] ** -0.5) > 1e-12:
        raise ValueError(f"this torch's varlen_attn has no 'scale' and the model's attention scale is {scale}")
    if q.shape[1] != k.shape[1] and "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    elif q.shape[1] != k.shape[1]:
        return per_kv_group(lambda group: varlen_attn(group, k, v, cu_q, cu_k, max_q, max_k, **kwargs), q, k.shape[1])
    return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)


def per_kv_group(attend: Callable[[torch.Tensor], torch.Tensor], q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Grouped-query attention as one call per query group, each with ``kv_heads`` query heads, for kernels that
    need equal head counts. Query head h reads K/V head h // groups, so group g is every groups-th head from g.
    Expanding K/V instead copies them (and reduces their gradient) ``groups`` times: on tree rows K/V are already
    gathered along every path, 3x the row's tokens, so that copy cost more than the attention it fed."""
    tokens, heads, dim = q.shape
    groups = heads // kv_heads
    folded = q.view(tokens, kv_heads, groups, dim)
    outputs = [attend(folded[:, :, g].contiguous()) for g in range(groups)]
    return torch.stack(outputs, dim=2).reshape(tokens, heads, -1)


@functools.cache
def _varlen_params() -> frozenset[str]:
    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


# ---- cascade: one varlen call per depth, merged by log-sum-exp -------------------------------------------------


@dataclass
class CascadePlan:
    layout: CascadeLayout
    kernel: CascadeKernel

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
        """Laid out [tokens, heads, dim] in the kernel's dtype, one copy per tensor where the dtype already fits;
        nothing is gathered along paths, so under autocast Qwen3's float32 keys are cast once, not once per path."""
        dtype, autocast = flash_dtype(query, value) if self.kernel.half_precision else (query.dtype, False)
        q, k, v = (t[0].transpose(0, 1).to(dtype, memory_format=torch.contiguous_format).contiguous()
                   for t in (query, key, value))  # fmt: skip
        out = cascade_attention(q, k, v, self.layout, self.kernel, scale).unsqueeze(0)
        return out if autocast else out.to(query.dtype)


@ATTENTION.register("cascade")
def cascade_plan(
    row: PackedRow, device: torch.device, kernel: CascadeKernel | None = None, window: int | None = None
) -> CascadePlan:
    """``kernel``: torch's flash ops on CUDA; a reference kernel (packing/cascade.py) elsewhere, for tests. A
    sliding window has a layout of its own (cascade.window_layout)."""
    if kernel is None:
        _needs_cuda("cascade", device)
        kernel = FlashKernel()
    layout = cascade_layout(row, device) if window is None else window_layout(row, window, device)
    return CascadePlan(layout, kernel)


# ---- flex: the ancestor relation as a block mask ---------------------------------------------------------------


def subtree_ends(row: PackedRow) -> torch.Tensor:
    """[L]: one past the last descendant of each position. In a depth-first layout, k is an ancestor of q
    (or q itself) iff k <= q < end[k]."""
    ends = torch.zeros(row.num_forwarded, dtype=torch.long)
    for seg in row.segments:
        ends.scatter_reduce_(0, seg.kv_index, torch.full_like(seg.kv_index, seg.q_end), reduce="amax")
    return ends


@dataclass
class FlexPlan:
    block_mask: Any
    length: int
    """Real tokens; the block mask covers a length padded up to FLEX_BUCKET (pad tokens see and are seen by none)."""

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
        dtype, pad = query.dtype, self.block_mask.shape[-2] - self.length
        query, key = query.to(value.dtype), key.to(value.dtype)  # float32 q/k beside bf16 v under autocast
        if pad:
            query, key, value = (F.pad(t, (0, 0, 0, pad)) for t in (query, key, value))
        gqa = query.shape[1] != key.shape[1]
        out = _flex_attention(query.device.type)(
            query, key, value, block_mask=self.block_mask, scale=scale, enable_gqa=gqa
        )
        return out[:, :, : self.length].transpose(1, 2).to(dtype)


@ATTENTION.register("flex")
def flex_plan(row: PackedRow, device: torch.device, bucket: int | None = None, window: int | None = None) -> FlexPlan:
    """Built uncompiled: a compiled builder would recompile for every new row length. Padded on CUDA only."""
    from torch.nn.attention.flex_attention import create_block_mask

    length = row.num_forwarded
    bucket = bucket or (FLEX_BUCKET if device.type == "cuda" else 1)
    padded = -(-length // bucket) * bucket
    ends = F.pad(subtree_ends(row), (0, padded - length)).to(device)
    positions = F.pad(row.position_ids, (0, padded - length)).to(device)

    def ancestor(batch, head, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return (kv_idx <= q_idx) & (q_idx < ends[kv_idx])

    def windowed(batch, head, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        near = positions[q_idx] - positions[kv_idx] < window
        return ancestor(batch, head, q_idx, kv_idx) & near

    mask = ancestor if window is None else windowed
    return FlexPlan(create_block_mask(mask, None, None, padded, padded, device=device), length)


@functools.cache
def _flex_attention(device_type: str) -> Callable[..., torch.Tensor]:
    """Compiled on CUDA (the fused kernel, backward included); eager elsewhere (forward only)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True) if device_type == "cuda" else flex_attention


# ---- kernels: FA3 from the Hub --------------------------------------------------------------------------------


@ATTENTION.register("kernels")
def kernels_plan(row: PackedRow, device: torch.device, window: int | None = None) -> TreePlan:
    kernel = _fa3_kernel() if device.type == "cuda" else None
    if kernel is None:
        _warn_fallback(device.type)
        return auto_plan(row, device, window=window)
    return varlen_plan(row, device, kernel=kernel, window=window)


@functools.cache
def _fa3_kernel() -> VarlenKernel | None:
    try:
        from kernels import get_kernel

        module = get_kernel(FA3_REPO, version=1)
    except Exception:  # unreachable Hub, missing package, no build for this GPU: all mean "use the fallback"
        return None

    def fa3(q, k, v, cu_q, cu_k, max_q, max_k, scale, window=None):  # type: ignore[no-untyped-def]
        left = -1 if window is None else window - 1
        out = module.flash_attn_varlen_func(
            q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=scale, causal=True, window_size=(left, 0)
        )
        return out[0] if isinstance(out, tuple) else out

    return fa3


@functools.cache
def _warn_fallback(device_type: str) -> None:
    fallback = "varlen" if device_type == "cuda" else "sdpa"
    warnings.warn(
        f"attention 'kernels': FA3 ({FA3_REPO}) is unavailable on {device_type}; using '{fallback}'", stacklevel=3
    )


# ---- auto, and wiring into transformers ------------------------------------------------------------------------


@ATTENTION.register("auto")
def auto_plan(row: PackedRow, device: torch.device, window: int | None = None) -> TreePlan:
    plan = varlen_plan if device.type == "cuda" else sdpa_plan
    return plan(row, device, window=window)


def build_plan(attention: str, row: PackedRow, device: torch.device, window: int | None = None) -> TreePlan:
    """The named backend's plan for one row, for layers of sliding window ``window`` (None: full attention); an
    unknown name lists the registered ones."""
    factory = ATTENTION.get(attention)
    return factory(row, device) if window is None else factory(row, device, window=window)


@dataclass(frozen=True)
class RowPlans:
    """The plans of one row, the `tree_plan` keyword of the model's forward: one per attention window of the model's
    layers (None: full attention), all built before the forward. Only plans travel as the keyword, never the row:
    FSDP's pre-forward hook walks every layer's keyword arguments for tensors, and a row holds one per segment (at
    0.5 s a layer on the CPU when the row travelled)."""

    plans: dict[int | None, TreePlan]

    @classmethod
    def build(cls, attention: str, row: PackedRow, device: torch.device, windows: set[int | None]) -> RowPlans:
        return cls({window: build_plan(attention, row, device, window) for window in windows})

    def plan(self, window: int | None) -> TreePlan:
        if window not in self.plans:
            planned = sorted(self.plans, key=str)
            raise ValueError(f"an attention layer asked for sliding window {window}, which the model's config "
                             f"(layer_types, sliding_window) does not name; planned: {planned}")  # fmt: skip
        return self.plans[window]


def attention_windows(model: torch.nn.Module) -> set[int | None]:
    """The sliding windows the model's attention layers use (None: full attention), from its text config."""
    text = unwrap_model(model).config.get_text_config()
    kinds = set(getattr(text, "layer_types", None) or ["full_attention"])
    windows: set[int | None] = {None} if kinds - {"sliding_attention"} else set()
    if "sliding_attention" in kinds:
        windows.add(text.sliding_window)
    return windows


@torch.compiler.disable
def tree_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):  # type: ignore[no-untyped-def]
    """transformers' attention-function contract; the row's structure arrives as the `tree_plan` keyword.
    Never traced by torch.compile: a plan is per-row Python data, and its kernels are already fused."""
    plans: RowPlans | None = kwargs.get("tree_plan")
    if plans is None:
        raise RuntimeError(
            f"attention '{TREE_ATTENTION}' needs a tree_plan: forward the model through "
            "asyncrl.trainer.forward.packed_forward, or call model.set_attn_implementation('sdpa') to use it alone"
        )
    if kwargs.get("softcap"):
        raise ValueError("tree attention does not softcap attention scores (check_model should have said so)")
    plan = plans.plan(kwargs.get("sliding_window"))
    return plan.attend(query, key, value, scaling if scaling is not None else query.shape[-1] ** -0.5), None


def attach_tree_attention(model: torch.nn.Module) -> None:
    """Route the model's attention through the tree plans (idempotent); rejects unsupported models first. A vision
    tower keeps its own attention: its patches are not the row's tokens (packing/images.py passes it images)."""
    inner = unwrap_model(model)
    if inner.config._attn_implementation == TREE_ATTENTION:
        return
    check_model(inner)
    _register()
    towers = [(tower, tower.config._attn_implementation) for tower in _vision_towers(inner)]
    inner.set_attn_implementation(TREE_ATTENTION)
    for tower, implementation in towers:
        tower.set_attn_implementation(implementation)


def _vision_towers(model: Any) -> list[Any]:
    """The sub-models of a vision-language model built on its vision config."""
    from transformers import PreTrainedModel

    vision = getattr(model.config, "vision_config", None)
    if vision is None:
        return []
    return [m for m in model.modules() if isinstance(m, PreTrainedModel) and m.config is vision]


@functools.cache
def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(TREE_ATTENTION, tree_attention_forward)


def unwrap_model(model: torch.nn.Module) -> Any:
    """The model inside DDP/FSDP1 wrappers (a peft model stays itself: it forwards attributes to its base)."""
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):  # DDP, FSDP1
        model = model.module
    return model


def check_model(model: torch.nn.Module) -> None:
    """Packed rows need every decoder layer to be causal attention (full or sliding-window) or a gated-DeltaNet
    layer of a family that packing/deltanet.py wraps; name what is not (attention sinks, bidirectional or
    softcapped attention, other token mixers)."""
    from asyncrl.packing.deltanet import unsupported_deltanet

    config = model.config
    name = getattr(config, "model_type", type(model).__name__)
    text = config.get_text_config()
    supported = {"full_attention", "sliding_attention", "linear_attention"}
    others = sorted(set(getattr(text, "layer_types", None) or []) - supported)
    if others:
        raise ValueError(
            f"packing: {name} has layer_types {others}; packed rows support full and sliding-window attention "
            "and gated DeltaNet layers (Qwen3.5, Qwen3.6, Qwen3-Next) only"
        )
    _check_causal_scores(name, text)
    sinks = sorted({type(m).__name__ for m in model.modules() if isinstance(getattr(m, "sinks", None), torch.Tensor)})
    if sinks:
        raise ValueError(f"packing: {name} has attention sinks ({', '.join(sinks)}), which packed rows do not support")
    unwrapped = unsupported_deltanet(model)
    if unwrapped:
        raise ValueError(
            f"packing: {name}'s gated DeltaNet layers {unwrapped} come from a modeling module asyncrl "
            "does not wrap (supported: Qwen3.5, Qwen3.5-MoE, Qwen3-Next)"
        )
    for layers_name, layers in model.named_modules():
        if layers_name.endswith("layers") and isinstance(layers, torch.nn.ModuleList):
            missing = [i for i, layer in enumerate(layers) if not _mixes_tokens(layer)]
            if missing:
                raise ValueError(
                    f"packing: {name} decoder layers {missing} have neither self_attn nor a gated "
                    "DeltaNet linear_attn (unsupported token mixer)"
                )
    if getattr(text, "attention_dropout", 0.0):
        raise ValueError(f"tree packing: {name} has attention_dropout={text.attention_dropout}; it must be 0")


def _check_causal_scores(name: str, text: Any) -> None:
    """Bidirectional attention (EmbeddingGemma) is no causal language model; a tanh cap on attention scores
    (Gemma 2) has no flash kernel in torch, so no packed backend could apply it. Gemma 3 sets neither."""
    if getattr(text, "use_bidirectional_attention", False):
        raise ValueError(f"packing: {name} has bidirectional attention; packed rows are causal")
    if getattr(text, "attn_logit_softcapping", None) is not None:
        raise ValueError(
            f"packing: {name} sets attn_logit_softcapping={text.attn_logit_softcapping}, which packed rows do not apply"
        )


def _mixes_tokens(layer: torch.nn.Module) -> bool:
    linear = getattr(layer, "linear_attn", None)
    return hasattr(layer, "self_attn") or type(linear).__name__.endswith("GatedDeltaNet")
