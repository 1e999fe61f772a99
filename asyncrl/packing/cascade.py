"""Cascade tree attention: a row's attention split into parts that gather no K/V along paths, merged by
log-sum-exp. The `cascade` backend of packing/attention.py builds a `CascadeLayout` per row and calls
`cascade_attention` in every attention layer.

A segment's queries see all of its ancestors' tokens and their own tokens causally. In a depth-first layout the
descendants of a segment are one contiguous span right after it, so the row splits into
- the *self* part: every segment against its own tokens, causal, over the layout as it is (one varlen call);
- one *ancestor* part per depth d: every segment at depth d that has descendants is a key sequence (its own
  tokens) for the query sequence of its descendants' span, not causal (one varlen call: the spans of one depth
  are disjoint).
Each token's K/V enters the self part and at most one ancestor part, where the `varlen` backend copies a prompt's
K/V once per completion and sums their gradients back.

A sliding-window layer (Gemma 3's) has one part (`window_layout`): each segment against its path's keys within the
window, gathered. Parts by depth cannot carry a window: flash aligns a window by index, and the query span of one
depth holds branches that restart at the same position. The copy is bounded: window - 1 keys per segment beyond
its own tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from asyncrl.packing.row import PackedRow, path_keys

Rows = slice | torch.Tensor
"""Layout positions of a part's queries or keys: a slice where they are one range (no copy), else an index."""


@dataclass(frozen=True)
class Sequences:
    """One varlen call's sequences: cumulative int32 lengths of queries and keys (on the device), their longest."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    causal: bool
    """Causal aligned bottom-right (the self part, and a window layout's one part)."""
    window: int | None = None
    """Sliding window, causal parts only: a query sees its own key and the window - 1 keys before it."""


class CascadeKernel(Protocol):
    """Varlen attention that exposes its log-sum-exp: q [Tq, Hq, D], k/v [Tk, Hkv, D] with Hq a multiple of Hkv
    (grouped-query attention natively); lse [Hq, Tq] (flash's varlen layout)."""

    half_precision: bool
    """The kernel takes fp16/bf16 only (flash); False for one that computes in the inputs' dtype."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: Sequences, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(out [Tq, Hq, D], lse [Hq, Tq])."""
        ...

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        seqs: Sequences,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(dq, dk, dv) with P = exp(S * scale - lse) and D = rowsum(dout * out) from the ``out`` and ``lse`` given."""
        ...


@dataclass
class Part:
    """One varlen call of a row: its queries and keys as layout positions, and their sequences."""

    q_rows: Rows
    k_rows: Rows
    seqs: Sequences


@dataclass
class CascadeLayout:
    """The parts of one row, the self part first (alone for a row without shared prefixes)."""

    parts: list[Part]


def cascade_layout(row: PackedRow, device: torch.device) -> CascadeLayout:
    """The self part and one ancestor part per depth that has segments with descendants."""
    segments = row.segments
    _check_tiling(row)
    depth, end = _subtrees(row, _parents(row))
    own = [(seg.q_start, seg.q_end) for seg in segments]
    parts = [_part(own, own, causal=True, device=device)]
    for level in range(max(depth, default=-1) + 1):
        forks = [s for s, seg in enumerate(segments) if depth[s] == level and end[s] > seg.q_end]
        if forks:
            spans = [(segments[s].q_end, end[s]) for s in forks]
            parts.append(_part(spans, [own[s] for s in forks], causal=False, device=device))
    return CascadeLayout(parts)


def window_layout(row: PackedRow, window: int, device: torch.device) -> CascadeLayout:
    """A sliding-window layer's one part: every segment's queries, causal and windowed, against its path's keys
    within the window (the layout itself where each segment's keys are its own tokens)."""
    _check_tiling(row)
    keys = path_keys(row.segments, window)
    cu_q, cu_k = _cumulative(keys.q_lens).to(device), _cumulative(keys.k_lens).to(device)
    seqs = Sequences(cu_q, cu_k, max(keys.q_lens), max(keys.k_lens), causal=True, window=window)
    layout = slice(0, row.num_forwarded)
    return CascadeLayout([Part(layout, layout if keys.gather is None else keys.gather.to(device), seqs)])


def _subtrees(row: PackedRow, parents: list[int]) -> tuple[list[int], list[int]]:
    """Each segment's depth, and the end of its subtree, checked to be one span: its descendants' tokens fill
    [q_end, end) exactly (a depth-first layout)."""
    depth = [0] * len(parents)
    for s, parent in enumerate(parents):
        depth[s] = depth[parent] + 1 if parent >= 0 else 0
    end = [seg.q_end for seg in row.segments]
    size = [seg.q_end - seg.q_start for seg in row.segments]
    for s in reversed(range(len(parents))):
        if parents[s] >= 0:
            end[parents[s]] = max(end[parents[s]], end[s])
            size[parents[s]] += size[s]
    for s, seg in enumerate(row.segments):
        if end[s] - seg.q_start != size[s]:
            raise ValueError(
                f"attention 'cascade': the descendants of segment {s} are not one span after it (the row is not "
                "laid out depth-first); use varlen or sdpa"
            )
    return depth, end


def _check_tiling(row: PackedRow) -> None:
    """Segments cover the layout in order, each right after the previous one: the self part is the layout."""
    bounds = [0]
    for s, seg in enumerate(row.segments):
        if seg.q_start != bounds[-1] or seg.q_end <= seg.q_start:
            raise ValueError(f"attention 'cascade': segment {s} does not start where the previous one ends")
        bounds.append(seg.q_end)
    if bounds[-1] != row.num_forwarded:
        raise ValueError(f"attention 'cascade': segments end at {bounds[-1]}, the row has {row.num_forwarded} tokens")


def _parents(row: PackedRow) -> list[int]:
    """Each segment's parent segment (-1 for a root): the one whose path, then the segment's own tokens, is the
    segment's path (what a trie's layout gives; anything else is refused)."""
    last = {seg.q_end - 1: s for s, seg in enumerate(row.segments)}
    parents = []
    for s, seg in enumerate(row.segments):
        own = torch.arange(seg.q_start, seg.q_end)
        first = int(seg.kv_index.numel()) - own.numel()
        parent = last.get(int(seg.kv_index[first - 1]), s) if first > 0 else -1
        if (
            first < 0
            or not torch.equal(seg.kv_index[first:], own)
            or parent >= s
            or (parent >= 0 and not torch.equal(seg.kv_index[:first], row.segments[parent].kv_index))
        ):
            raise ValueError(
                f"attention 'cascade': segment {s}'s path is not an earlier segment's path followed by its own "
                "tokens; use varlen or sdpa"
            )
        parents.append(parent)
    return parents


def _part(q_spans: list[tuple[int, int]], k_spans: list[tuple[int, int]], causal: bool, device: torch.device) -> Part:
    q_lens, k_lens = [b - a for a, b in q_spans], [b - a for a, b in k_spans]
    seqs = Sequences(_cumulative(q_lens).to(device), _cumulative(k_lens).to(device), max(q_lens), max(k_lens), causal)
    return Part(_rows(q_spans, device), _rows(k_spans, device), seqs)


def _rows(spans: list[tuple[int, int]], device: torch.device) -> Rows:
    """A slice where the spans are one range; spans of one depth never touch (a subtree lies between them)."""
    if all(spans[i][1] == spans[i + 1][0] for i in range(len(spans) - 1)):
        return slice(spans[0][0], spans[-1][1])
    return torch.cat([torch.arange(a, b) for a, b in spans]).to(device)


def _cumulative(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)


# ---- the merge and its backward ----------------------------------------------------------------------------------


def cascade_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: CascadeLayout, kernel: CascadeKernel, scale: float
) -> torch.Tensor:
    """q [L, Hq, D], k/v [L, Hkv, D] (contiguous, the kernel's dtype) -> [L, Hq, D]."""
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"attention 'cascade': {q.shape[1]} query heads are not a multiple of {k.shape[1]} K/V heads")
    return CascadeAttention.apply(q, k, v, layout, kernel, scale)


class CascadeAttention(torch.autograd.Function):
    """The parts' outputs merged by log-sum-exp: out = sum_i exp(lse_i - LSE) out_i, LSE = logsumexp_i lse_i over
    the parts a query takes part in.

    The backward does not differentiate through the lse's. Each part's flash backward gets the *merged* output and
    the *global* LSE in place of its own: the kernel then computes P = exp(S * scale - LSE), the probabilities of
    attention over the union of all parts' keys, and D = rowsum(dO * O_merged), which is exactly that attention's
    gradient restricted to the part's keys (the ring/cascade-attention identity).

    Precision in the kernel's dtype (bf16), rounding each sum over parts once: a key's gradient has at most two
    terms (its own segment's queries, and its descendants' in the one ancestor part of its depth), and a single
    bf16 add (index_add_ too) computes in float32 and rounds once, so dk/dv stay bf16; a query's gradient has a
    term per ancestor depth plus its own, so with more than one ancestor part (a shared system prefix above the
    prompts) dq is summed in a float32 buffer, where bf16 would round again at every addition. The forward merges
    each part into the rows of its queries by one lerp in the output's dtype (weights exp(lse_i - LSE) in [0, 1]):
    a float32 copy of the whole output would cost more memory traffic than the attention it merges.
    """

    @staticmethod
    def forward(ctx, q, k, v, layout, kernel, scale):  # type: ignore[no-untyped-def]
        out, lse = _merged_forward(q, k, v, layout, kernel, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layout, ctx.kernel, ctx.scale = layout, kernel, scale
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[no-untyped-def]
        q, k, v, out, lse = ctx.saved_tensors
        grads = _merged_backward(dout.contiguous(), q, k, v, out, lse, ctx.layout, ctx.kernel, ctx.scale)
        return *grads, None, None, None


def _merged_forward(q, k, v, layout: CascadeLayout, kernel: CascadeKernel, scale: float):  # type: ignore[no-untyped-def]
    """Self part first (all of the layout's queries), then each ancestor part merged into its queries' rows (an
    online log-sum-exp merge)."""
    own, *ancestors = layout.parts
    out, lse = kernel.forward(q, _take(k, own.k_rows), _take(v, own.k_rows), own.seqs, scale)
    for part in ancestors:
        rows, keys = part.q_rows, part.k_rows
        part_out, part_lse = kernel.forward(_take(q, rows), _take(k, keys), _take(v, keys), part.seqs, scale)
        before = _take(lse, rows, dim=1)
        total = torch.logaddexp(before, part_lse)
        weight = (part_lse - total).exp().T.unsqueeze(-1).to(out.dtype)  # [Tq, H, 1]: the part's share
        _put(out, rows, torch.lerp(_take(out, rows), part_out, weight))
        _put(lse, rows, total, dim=1)
    return out, lse


def _merged_backward(dout, q, k, v, out, lse, layout: CascadeLayout, kernel: CascadeKernel, scale: float):  # type: ignore[no-untyped-def]
    own, *ancestors = layout.parts
    keys = own.k_rows
    dq, own_dk, own_dv = kernel.backward(dout, q, _take(k, keys), _take(v, keys), out, lse, own.seqs, scale)
    dk, dv = _spread(own_dk, k, keys), _spread(own_dv, v, keys)
    if len(ancestors) > 1:
        dq = dq.to(_accumulation(dq.dtype))
    for part in ancestors:
        rows, keys = part.q_rows, part.k_rows
        part_lse = _take(lse, rows, dim=1).contiguous()  # the flash kernel reads it as a dense [H, Tq]
        inputs = (_take(dout, rows), _take(q, rows), _take(k, keys), _take(v, keys), _take(out, rows), part_lse)
        part_dq, part_dk, part_dv = kernel.backward(*inputs, part.seqs, scale)
        _add(dq, rows, part_dq)
        _add(dk, keys, part_dk)
        _add(dv, keys, part_dv)
    return dq.to(q.dtype), dk, dv


def _accumulation(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _take(t: torch.Tensor, rows: Rows, dim: int = 0) -> torch.Tensor:
    if isinstance(rows, slice):
        return t[rows] if dim == 0 else t[:, rows]
    return t.index_select(dim, rows)


def _put(t: torch.Tensor, rows: Rows, value: torch.Tensor, dim: int = 0) -> None:
    if isinstance(rows, slice):
        (t[rows] if dim == 0 else t[:, rows]).copy_(value)
    else:
        t.index_copy_(dim, rows, value)


def _spread(grad: torch.Tensor, like: torch.Tensor, rows: Rows) -> torch.Tensor:
    """The gradient of keys taken at ``rows`` as one over all of ``like``'s rows, itself where it already is. A
    window layout's prompt key is taken by every completion whose window reaches it: summed in float32, rounded
    once."""
    if grad.shape[0] == like.shape[0] and isinstance(rows, slice):
        return grad
    total = torch.zeros(like.shape, dtype=_accumulation(grad.dtype), device=grad.device)
    _add(total, rows, grad)
    return total.to(grad.dtype)


def _add(t: torch.Tensor, rows: Rows, value: torch.Tensor) -> None:
    if isinstance(rows, slice):
        t[rows] += value.to(t.dtype)
    else:
        t.index_add_(0, rows, value.to(t.dtype))


# ---- kernels -----------------------------------------------------------------------------------------------------


class FlashKernel:
    """torch's own FlashAttention-2 varlen ops (CUDA, fp16/bf16), called with the arguments torch 2.11 has too.

    The varlen log-sum-exp is [H, total_q] float32, dense ("unpadded_lse"): mha_varlen_fwd allocates
    ``softmax_lse = at::empty({num_heads, total_q})`` and mha_varlen_bwd reads it through its data pointer
    (pytorch/pytorch aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp; the same shape in the fake
    of torch/nn/attention/varlen.py). A max_q of 1 with grouped-query heads and no causal mask makes the forward
    fold the query groups into the sequence dimension and reshape the lse differently, so max_q is passed as at
    least 2 (it only sizes the launch grid; every sequence's length comes from cu_q)."""

    half_precision = True

    def forward(self, q, k, v, seqs: Sequences, scale: float):  # type: ignore[no-untyped-def]
        out, lse, *_ = torch.ops.aten._flash_attention_forward(
            q, k, v, seqs.cu_q, seqs.cu_k, max(seqs.max_q, 2), seqs.max_k, 0.0, seqs.causal, False, scale=scale,
            **_flash_window(seqs),
        )  # fmt: skip
        return out, lse

    def backward(self, dout, q, k, v, out, lse, seqs: Sequences, scale: float):  # type: ignore[no-untyped-def]
        """No dropout: the rng state (seed, offset) is unread, as in torch's own varlen_attn backward."""
        rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)
        unused = torch.empty(0, device=q.device)
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            dout, q, k, v, out, lse, seqs.cu_q, seqs.cu_k, max(seqs.max_q, 2), seqs.max_k, 0.0, seqs.causal,
            rng_state, unused, scale=scale, **_flash_window(seqs),
        )  # fmt: skip
        return dq, dk, dv


def _flash_window(seqs: Sequences) -> dict[str, int]:
    """A sliding window as flash's (left, right) window sizes; nothing for full attention."""
    return {} if seqs.window is None else {"window_size_left": seqs.window - 1, "window_size_right": 0}


class ReferenceKernel:
    """The flash math in plain torch, in the inputs' dtype (CPU tests): the forward returns out and lse; the
    backward recomputes P from the lse it is given (not its own), so the tests check the merge and the backward
    identity for real."""

    half_precision = False

    def forward(self, q, k, v, seqs: Sequences, scale: float):  # type: ignore[no-untyped-def]
        out, lse = torch.empty_like(q), q.new_empty(q.shape[1], q.shape[0])
        for rows, keys in _ranges(seqs):
            scores = _scores(q[rows], _grouped(k[keys], q.shape[1]), seqs, scale)
            lse[:, rows] = scores.logsumexp(-1)
            out[rows] = torch.einsum("hqk,khd->qhd", (scores - lse[:, rows, None]).exp(), _grouped(v[keys], q.shape[1]))
        return out, lse

    def backward(self, dout, q, k, v, out, lse, seqs: Sequences, scale: float):  # type: ignore[no-untyped-def]
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        heads, kv_heads = q.shape[1], k.shape[1]
        for rows, keys in _ranges(seqs):
            key, value = _grouped(k[keys], heads), _grouped(v[keys], heads)
            probs = (_scores(q[rows], key, seqs, scale) - lse[:, rows, None]).exp()  # [H, q, k]
            d_probs = torch.einsum("qhd,khd->hqk", dout[rows], value)
            delta = (dout[rows] * out[rows]).sum(-1).T.unsqueeze(-1)  # [H, q, 1]
            d_scores = probs * (d_probs - delta)
            dq[rows] = torch.einsum("hqk,khd->qhd", d_scores, key) * scale
            dk[keys] = _ungrouped(torch.einsum("hqk,qhd->khd", d_scores, q[rows]) * scale, kv_heads)
            dv[keys] = _ungrouped(torch.einsum("hqk,qhd->khd", probs, dout[rows]), kv_heads)
        return dq, dk, dv


def _ranges(seqs: Sequences) -> list[tuple[slice, slice]]:
    cu_q, cu_k = seqs.cu_q.tolist(), seqs.cu_k.tolist()
    return [(slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])) for i in range(len(cu_q) - 1)]


def _scores(q: torch.Tensor, k: torch.Tensor, seqs: Sequences, scale: float) -> torch.Tensor:
    """[H, q, k] scaled scores, -inf where a causal mask or a sliding window (aligned bottom-right) hides the key."""
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if seqs.causal:
        n_q, n_k = q.shape[0], k.shape[0]
        hidden = torch.ones(n_q, n_k, dtype=torch.bool).triu(diagonal=n_k - n_q + 1)
        if seqs.window is not None:
            hidden |= torch.ones(n_q, n_k, dtype=torch.bool).tril(diagonal=n_k - n_q - seqs.window)
        scores = scores.masked_fill(hidden, float("-inf"))
    return scores


def _grouped(t: torch.Tensor, heads: int) -> torch.Tensor:
    """K/V heads repeated for their query group: query head h reads K/V head h // groups."""
    return t.repeat_interleave(heads // t.shape[1], dim=1)


def _ungrouped(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """A gradient over query heads summed back onto the K/V head each group read."""
    return t.view(t.shape[0], kv_heads, -1, t.shape[-1]).sum(2)
