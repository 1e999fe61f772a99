"""Cascade tree attention: the per-depth parts of a row, and their log-sum-exp merge (and its backward) against
the explicit mask, in float64 with the reference kernel; on CUDA, torch's flash ops in bf16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from packing_samples import make_sample, random_samples

from asyncrl.packing import FlatRow, PackedRow, Segment, TreeRow
from asyncrl.packing.attention import build_plan, cascade_plan, tree_attention_mask, varlen_plan
from asyncrl.packing.cascade import ReferenceKernel, cascade_layout

CPU = torch.device("cpu")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def packed(samples, row_cls=TreeRow):
    row = row_cls(10_000)
    for sample in samples:
        row.add(sample)
    return row.pack(0)


def grpo_row():
    """Two prompts sharing a system prefix (depth 3: system, prompt, completion), a few completions each."""
    system, prompts = [1, 2, 3], [[4, 5, 6, 7], [8, 9]]
    samples = [make_sample(system + prompt + [10 + i, 20 + i, 30 + i][: i + 1], len(system) + len(prompt), g, seed=i)
               for g, prompt in enumerate(prompts) for i in range(3)]  # fmt: skip
    return packed(samples)


def multi_turn_row():
    """prompt -> turn 1 -> tool result -> turn 2 (two of them), and a one-token leaf: depth 4."""
    prompt, turn, tool = [1, 2, 3], [4, 5], [6, 7, 8]
    return packed([
        make_sample(prompt + turn, 3),
        make_sample(prompt + turn + tool + [9, 10], 8),
        make_sample(prompt + turn + tool + [11], 8),
        make_sample(prompt + [12, 13], 3),
    ])  # fmt: skip


def flat_row():
    return packed([make_sample([1, 2, 3], 1), make_sample([1, 2, 3, 4], 1), make_sample([5], 0)], FlatRow)


def hand_row(paths: list[list[int]]) -> PackedRow:
    """Segments given by their paths, each ending with its own positions (which tile the layout in order)."""
    segments, start = [], 0
    for path in paths:
        own = len(path) - path.index(start)
        segments.append(Segment(start, start + own, torch.tensor(path)))
        start += own
    empty = torch.zeros(0, dtype=torch.long)
    return PackedRow(torch.zeros(start, dtype=torch.long), torch.zeros(start, dtype=torch.long), segments,
                     empty, empty, empty, empty.float(), empty.float())  # fmt: skip


def single_token_row():
    """Every segment one token, and an ancestor part of one query: every call has max_q 1."""
    return hand_row([[0], [0, 1], [2], [2, 3], [4]])


def test_parts_of_the_spec_example():
    row = packed([make_sample([1, 2, 3, 4, 5], 3), make_sample([1, 2, 3, 6, 7], 3)])  # [1 2] | [3 4 5] | [3 6 7]
    own, prompt = cascade_layout(row, CPU).parts
    assert own.q_rows == own.k_rows == slice(0, 8)
    assert own.seqs.cu_q.tolist() == own.seqs.cu_k.tolist() == [0, 2, 5, 8] and own.seqs.causal
    assert (prompt.q_rows, prompt.k_rows) == (slice(2, 8), slice(0, 2))  # one span: slices, nothing gathered
    assert prompt.seqs.cu_q.tolist() == [0, 6] and prompt.seqs.cu_k.tolist() == [0, 2] and not prompt.seqs.causal


def test_one_part_per_depth_with_descendants_and_each_key_in_at_most_one_ancestor_part():
    row = grpo_row()
    parts = cascade_layout(row, CPU).parts
    assert len(parts) == 3  # self, the system prefix, the two prompts
    prompts = parts[2]
    assert prompts.seqs.cu_q.numel() == 3 and isinstance(prompts.q_rows, torch.Tensor)
    keys = torch.cat([torch.arange(row.num_forwarded)[p.k_rows] for p in parts[1:]])
    assert keys.unique().numel() == keys.numel()
    # a fork comes one token early (packing/trie.py): system [1 2], prompts [3 4 5 6] and [3 8]
    assert [seg.q_end - seg.q_start for seg in row.segments if seg.q_start in keys.tolist()] == [2, 4, 2]


def test_a_flat_row_is_the_self_part_alone():
    assert len(cascade_layout(flat_row(), CPU).parts) == 1


def test_rows_not_laid_out_depth_first_are_refused():
    with pytest.raises(ValueError, match="segment 1's path is not an earlier segment's path followed by its own"):
        cascade_layout(hand_row([[0, 1], [1, 2, 3]]), CPU)  # half of its parent's path
    with pytest.raises(ValueError, match="the descendants of segment 0 are not one span after it"):
        cascade_layout(hand_row([[0, 1], [2], [0, 1, 3]]), CPU)  # a root between the prompt and its child


def test_cascade_needs_cuda_without_a_kernel():
    with pytest.raises(ValueError, match="attention 'cascade' needs a CUDA device.*use sdpa or auto"):
        build_plan("cascade", flat_row(), CPU)


def mask_attention(q, k, v, row, scale):
    """The sdpa plan's explicit mask over [L, H, D] tensors."""
    mask = tree_attention_mask(row).to(q.device)
    out = F.scaled_dot_product_attention(*(t.transpose(0, 1)[None] for t in (q, k, v)), attn_mask=mask,
                                         scale=scale, enable_gqa=True)  # fmt: skip
    return out[0].transpose(0, 1)


def random_qkv(length, dtype=torch.float64, device=CPU, seed=0):
    generator = torch.Generator(device).manual_seed(seed)
    q = torch.randn(length, 4, 8, dtype=dtype, device=device, generator=generator)  # 4 query heads over 2 K/V heads
    k, v = (torch.randn(length, 2, 8, dtype=dtype, device=device, generator=generator) for _ in range(2))
    return [t.requires_grad_() for t in (q, k, v)]


ROWS = [lambda: packed(random_samples(seed=3)), multi_turn_row, grpo_row, flat_row, single_token_row]


@pytest.mark.parametrize("make_row", ROWS)
def test_merge_and_backward_match_the_mask_in_float64(make_row):
    row = make_row()
    q, k, v = random_qkv(row.num_forwarded)
    plan = cascade_plan(row, CPU, kernel=ReferenceKernel())
    out = plan.attend(*(t.transpose(0, 1)[None] for t in (q, k, v)), 0.3)[0]
    expected = mask_attention(q, k, v, row, 0.3)
    assert (out - expected).abs().max() <= 1e-10
    weights = torch.randn_like(out)
    grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
    for got, want in zip(grads, torch.autograd.grad((expected * weights).sum(), (q, k, v)), strict=True):
        assert (got - want).abs().max() <= 1e-10


def test_a_flat_row_calls_the_kernel_once_each_way():
    calls = []

    class Counting(ReferenceKernel):
        def forward(self, *args):
            calls.append("forward")
            return super().forward(*args)

        def backward(self, *args):
            calls.append("backward")
            return super().backward(*args)

    row = flat_row()
    q, k, v = random_qkv(row.num_forwarded)
    out = cascade_plan(row, CPU, kernel=Counting()).attend(*(t.transpose(0, 1)[None] for t in (q, k, v)), 0.3)
    out.sum().backward()
    assert calls == ["forward", "backward"]


# ---- GPU: torch's flash ops in bf16 --------------------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("make_row", ROWS)
def test_gpu_flash_cascade_is_as_close_to_float64_as_varlen_in_bf16(make_row):
    """Errors against the float64 mask, outputs and dq/dk/dv: cascade's are within varlen's (the lse layout, the
    grouped heads and the backward's arguments of torch's flash ops are right), also where max_q is 1."""
    row, cuda = make_row(), torch.device("cuda")
    q64, k64, v64 = random_qkv(row.num_forwarded, device=cuda)
    expected = mask_attention(q64, k64, v64, row, 0.125)
    weights = torch.randn_like(expected)
    reference = torch.autograd.grad((expected * weights).sum(), (q64, k64, v64))
    errors = {}
    for name, plan in (("varlen", varlen_plan(row, cuda)), ("cascade", cascade_plan(row, cuda))):
        q, k, v = (t.detach().to(torch.bfloat16).requires_grad_() for t in (q64, k64, v64))
        out = plan.attend(*(t.transpose(0, 1)[None] for t in (q, k, v)), 0.125)[0]
        grads = torch.autograd.grad((out.double() * weights).sum(), (q, k, v))
        errors[name] = [float((got.double() - want).abs().max() / want.abs().max())
                        for got, want in zip((out, *grads), (expected, *reference), strict=True)]  # fmt: skip
    assert all(c <= max(2 * v, 0.02) for c, v in zip(errors["cascade"], errors["varlen"], strict=True)), errors
