"""Gated DeltaNet layers on packed rows: each sample's convolution and recurrence see its own history only.

A gated-DeltaNet layer (Qwen3.5, Qwen3.6, Qwen3-Next) mixes tokens twice: a short causal depthwise convolution
over the last ``K`` tokens, then the chunked gated delta rule, a recurrence whose state flows from token to token.
On a packed row the layout's neighbours are not a token's history, so both are taken per segment:

- convolution: a segment's first ``K - 1`` positions read their predecessors along their own root-to-segment path
  (its parent's last tokens in a tree row, nothing before a sample's first token); every other position's
  predecessors are the layout's, so the plain convolution over the row is right there and only those few
  positions are recomputed;
- recurrence: segments run level by level down the trie (roots first, all segments of a level in one batched
  call); a segment starts from its parent's final state, a root from zeros. The states are ordinary tensors of the
  autograd graph, so gradients flow back through them into the parent segments.

transformers' gated-DeltaNet layers call the module-level ``causal_conv1d_fn`` and ``torch_chunk_gated_delta_rule``
with the layer's keyword arguments, so ``install`` swaps those two names for dispatchers that take this module's
``recurrent_plan`` keyword (passed by ``packed_forward``) and call the originals unchanged otherwise. The recurrence
itself is transformers' own reference (``torch_chunk_gated_delta_rule``), or fla's Triton kernel on CUDA with
varlen ``cu_seqlens`` and per-sequence initial states, instead of padding each level to its longest segment; the
row's plain convolution is fla's Triton kernel there too, in place of the reference depthwise ``F.conv1d``.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from asyncrl.packing.row import PackedRow

FAMILY_MODULES = (
    "transformers.models.qwen3_5.modeling_qwen3_5",
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
    "transformers.models.qwen3_next.modeling_qwen3_next",
)
"""Modeling modules whose gated-DeltaNet layers call the two module-level functions that ``install`` wraps."""
CONV_FUNCTION, RULE_FUNCTION = "causal_conv1d_fn", "torch_chunk_gated_delta_rule"
PLAN_KEYWORD = "recurrent_plan"


@dataclass
class Level:
    """The segments at one depth of the trie, run together."""

    positions: torch.Tensor  # [T] layout positions of the level's segments, concatenated
    lengths: list[int]
    parents: torch.Tensor | None  # [N] index of each segment's parent among the earlier levels' segments; None: roots
    gather: torch.Tensor  # [N, longest] layout position of each padded slot, L (a zero row) where padded
    valid: torch.Tensor  # [N, longest] bool: the slot holds a token
    cu_seqlens: torch.Tensor  # [N + 1] long


@dataclass
class RecurrentPlan:
    """How one packed row runs through every gated-DeltaNet layer (built once per row)."""

    length: int
    conv_positions: torch.Tensor  # [F] positions whose convolution window reaches before their segment
    conv_window: torch.Tensor  # [F, K] their window along their own path (oldest first, itself last); -1: none
    levels: list[Level]
    order: torch.Tensor  # [L] the inverse permutation of the levels' concatenated positions


def build_recurrent_plan(row: PackedRow, kernel_size: int, device: torch.device) -> RecurrentPlan:
    """The plan of ``row`` for convolutions of ``kernel_size`` taps, on ``device``."""
    ends = {seg.q_end - 1: s for s, seg in enumerate(row.segments)}
    depth, parent = [0] * len(row.segments), [-1] * len(row.segments)
    conv_positions, conv_window = [], []
    for s, seg in enumerate(row.segments):
        n_q = seg.q_end - seg.q_start
        first = int(seg.kv_index.numel()) - n_q  # where the segment's own positions start in its path
        lo = max(0, first - kernel_size + 1)
        near = seg.kv_index[lo : first + min(kernel_size - 1, n_q)].tolist()  # the path around that start
        if first > 0:
            parent[s] = ends[near[first - 1 - lo]]
            depth[s] = depth[parent[s]] + 1
        for at in range(first, first + min(kernel_size - 1, n_q)):
            conv_positions.append(near[at - lo])
            conv_window.append([near[i - lo] if i >= 0 else -1 for i in range(at - kernel_size + 1, at + 1)])
    levels, ordinal = [], {}
    for level in range(max(depth, default=-1) + 1):
        members = [s for s in range(len(row.segments)) if depth[s] == level]
        for s in members:
            ordinal[s] = len(ordinal)
        parents = torch.tensor([ordinal[parent[s]] for s in members]) if level else None
        levels.append(_level([row.segments[s] for s in members], parents, row.num_forwarded, device))
    concatenated = torch.cat([level.positions for level in levels]) if levels else torch.zeros(0, dtype=torch.long)
    order = torch.empty_like(concatenated)
    order[concatenated] = torch.arange(concatenated.numel(), device=concatenated.device)
    window = torch.tensor(conv_window, dtype=torch.long).reshape(-1, kernel_size)
    return RecurrentPlan(
        row.num_forwarded,
        torch.tensor(conv_positions, dtype=torch.long).to(device),
        window.to(device),
        levels,
        order.to(device),
    )


def _level(segments: list, parents: torch.Tensor | None, length: int, device: torch.device) -> Level:
    lengths = [seg.q_end - seg.q_start for seg in segments]
    longest = max(lengths)
    slots = torch.arange(longest)
    starts = torch.tensor([seg.q_start for seg in segments])
    valid = slots[None] < torch.tensor(lengths)[:, None]
    gather = torch.where(valid, starts[:, None] + slots[None], torch.full_like(valid, length, dtype=torch.long))
    positions = torch.cat([torch.arange(seg.q_start, seg.q_end) for seg in segments])
    cu_seqlens = torch.tensor([0, *lengths]).cumsum(0)
    return Level(
        positions.to(device),
        lengths,
        None if parents is None else parents.to(device),
        gather.to(device),
        valid.to(device),
        cu_seqlens.to(device),
    )


# ---- the two layer functions on a plan ---------------------------------------------------------------------------


def packed_conv(
    original: Callable[..., torch.Tensor],
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
    plan: RecurrentPlan,
) -> torch.Tensor:
    """[1, C, L] -> [1, C, L]: the plain convolution over the row, with the positions near a segment start
    recomputed from their own window (``weight`` [C, K], the last tap on the token itself)."""
    from transformers.activations import ACT2FN

    kernel = _fla_conv() if _fla_device(hidden_states) else None
    if kernel is None:
        out = original(hidden_states, weight, bias, activation=None)
    else:  # fla takes [B, L, C]: the layer's own layout before its transpose, so no copy either way
        out = kernel(hidden_states.transpose(1, 2), weight, bias)[0].transpose(1, 2)
    if plan.conv_positions.numel():
        rows = F.pad(hidden_states[0].to(weight.dtype), (1, 0))  # column 0 reads as "before the sample": zeros
        window = rows[:, plan.conv_window + 1]  # [C, F, K]
        fixed = (window * weight[:, None, :]).sum(-1)
        if bias is not None:
            fixed = fixed + bias[:, None]
        out = out.index_copy(2, plan.conv_positions, fixed.to(out.dtype)[None])
    return out if activation is None else ACT2FN[activation](out)


def packed_delta_rule(
    original: Callable[..., Any],
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    use_qk_l2norm_in_kernel: bool,
    plan: RecurrentPlan,
) -> torch.Tensor:
    """[1, L, H, D] inputs -> [1, L, H_v, D_v]: the chunked gated delta rule per segment, level by level, each
    segment from its parent's final state. Grouped values (more value than key heads) pass through as they came:
    both kernels take them."""
    run = _fla_level if _fla_device(query) and _fla_rule() is not None else functools.partial(_torch_level, original)
    outputs, finals = [], None
    for level in plan.levels:
        initial = None if level.parents is None else finals.index_select(0, level.parents)
        out, final = run(query, key, value, g, beta, use_qk_l2norm_in_kernel, level, initial)
        outputs.append(out)
        finals = final if finals is None else torch.cat([finals, final])
    return torch.cat(outputs).index_select(0, plan.order)[None]


def _torch_level(
    original: Callable[..., Any], query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
    beta: torch.Tensor, l2norm: bool, level: Level, initial: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One level through transformers' torch reference (unwrapped: transformers may route the name to fla, which
    ``_fla_rule`` judges), segments right-padded to the longest. Padded slots have zero
    q/k/v, beta and log-decay: they add nothing to the state and do not decay it, so the final state is the one
    after the segment's last real token."""
    padded = [F.pad(t[0], (0, 0) * (t.dim() - 2) + (0, 1))[level.gather] for t in (query, key, value, g, beta)]
    reference = inspect.unwrap(original)
    out, final = reference(
        *padded[:3],
        g=padded[3],
        beta=padded[4],
        initial_state=initial,
        output_final_state=True,
        use_qk_l2norm_in_kernel=l2norm,
    )
    return out[level.valid], final


def _fla_level(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, l2norm: bool,
    level: Level, initial: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One level through fla's varlen Triton kernel: no padding, one sequence per segment."""
    q, k, v, gates, betas = (t.index_select(1, level.positions) for t in (query, key, value, g, beta))
    out, final = _fla_rule()(
        q,
        k,
        v,
        g=gates.float(),
        beta=betas,
        initial_state=initial,
        output_final_state=True,
        cu_seqlens=level.cu_seqlens,
        use_qk_l2norm_in_kernel=l2norm,
    )
    return out[0], final


def _fla_device(tensor: torch.Tensor) -> bool:
    """Whether fla's Triton kernels take ``tensor`` where it is: on CUDA (the CPU keeps transformers' reference)."""
    return tensor.is_cuda


@functools.cache
def _fla_rule() -> Callable[..., Any] | None:
    """fla's chunked gated delta rule, or None, with one warning saying why, when fla is missing or its backward is
    known to be wrong on this GPU and Triton (fla's own check: Hopper with Triton 3.4-3.7.0 and no tilelang)."""
    reason = fla_unusable()
    if reason is not None:
        warnings.warn(
            f"gated DeltaNet on CUDA: {reason}; using transformers' torch reference, which is much slower", stacklevel=4
        )
        return None
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    return chunk_gated_delta_rule


@functools.cache
def _fla_conv() -> Callable[..., Any] | None:
    """fla's Triton causal convolution ([B, L, C] in and out), or None where ``_fla_rule`` is (it says why): the
    kernel transformers' fast path would take from the ``causal-conv1d`` package, which ships no wheels."""
    if _fla_rule() is None:
        return None
    from fla.modules.causal_conv1d import causal_conv1d

    return causal_conv1d


def fla_unusable() -> str | None:
    """Why fla's kernel cannot train here, or None when it can."""
    if importlib.util.find_spec("fla") is None:
        return "fla is not installed (pip install fla-core)"
    from fla.utils import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1

    broken = IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1
    if broken and importlib.util.find_spec("tilelang") is None:
        import triton

        return (
            f"fla's gated backward is wrong on Hopper with Triton {triton.__version__} (fla issue 640): upgrade "
            "Triton to >= 3.7.1 or pip install tilelang"
        )
    return None


# ---- wiring into transformers ------------------------------------------------------------------------------------


@functools.cache
def install() -> tuple[str, ...]:
    """Wrap the two functions in every gated-DeltaNet family module this transformers has (once); return the
    modules wrapped. Without a ``recurrent_plan`` keyword the wrappers call the originals unchanged."""
    wrapped = []
    for name in FAMILY_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        conv, rule = getattr(module, CONV_FUNCTION, None), getattr(module, RULE_FUNCTION, None)
        if conv is None or rule is None:
            continue
        setattr(module, CONV_FUNCTION, _conv_dispatcher(conv))
        setattr(module, RULE_FUNCTION, _rule_dispatcher(rule))
        wrapped.append(name)
    return tuple(wrapped)


def _conv_dispatcher(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    @torch.compiler.disable
    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):  # type: ignore[no-untyped-def]
        plan = kwargs.pop(PLAN_KEYWORD, None)
        if plan is None:
            return original(hidden_states, weight, bias, activation=activation, **kwargs)
        return packed_conv(original, hidden_states, weight, bias, activation, plan)

    return causal_conv1d_fn


def _rule_dispatcher(original: Callable[..., Any]) -> Callable[..., Any]:
    @torch.compiler.disable
    def torch_chunk_gated_delta_rule(query, key, value, g, beta, *args, **kwargs):  # type: ignore[no-untyped-def]
        plan = kwargs.pop(PLAN_KEYWORD, None)
        if plan is None:
            return original(query, key, value, g, beta, *args, **kwargs)
        out = packed_delta_rule(original, query, key, value, g, beta, kwargs["use_qk_l2norm_in_kernel"], plan)
        return out, None

    return torch_chunk_gated_delta_rule


def deltanet_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's gated-DeltaNet modules (the token mixers of its "linear_attention" layers)."""
    return [module for module in model.modules() if type(module).__name__.endswith("GatedDeltaNet")]


def unsupported_deltanet(model: torch.nn.Module) -> list[str]:
    """Class names of gated-DeltaNet modules whose modeling module ``install`` cannot wrap."""
    wrapped = set(install())
    return sorted({type(m).__name__ for m in deltanet_layers(model) if type(m).__module__ not in wrapped})


def conv_kernel_size(model: torch.nn.Module) -> int:
    """The convolution width of the model's gated-DeltaNet layers (one value per model)."""
    sizes = {int(module.conv_kernel_size) for module in deltanet_layers(model)}
    if len(sizes) != 1:
        raise ValueError(f"gated DeltaNet layers with convolution widths {sorted(sizes)}: expected one")
    return sizes.pop()
