"""Tree attention backends: selection, plans, the transformers wiring, the model check; GPU backends on CUDA."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from packing_samples import build_tiny_qwen3, make_sample, random_samples
from torch.overrides import TorchFunctionMode
from transformers import Qwen3Config, Qwen3ForCausalLM

from asyncrl.packing import FlatRow, TreeRow
from asyncrl.packing.attention import (
    ATTENTION,
    TREE_ATTENTION,
    FlexPlan,
    MaskPlan,
    VarlenPlan,
    _warn_fallback,
    attach_tree_attention,
    build_plan,
    check_model,
    per_kv_group,
    subtree_ends,
    tree_attention_mask,
    varlen_plan,
)
from asyncrl.registry import RegistryError
from asyncrl.trainer.forward import packed_forward

CPU = torch.device("cpu")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def spec_row():
    row = TreeRow(100)
    row.add(make_sample([1, 2, 3, 4, 5], prompt_len=3))
    row.add(make_sample([1, 2, 3, 6, 7], prompt_len=3))
    return row.pack(0)


def test_registry_names_every_backend_and_rejects_unknown_ones():
    assert {"auto", "sdpa", "varlen", "cascade", "flex", "kernels"} <= set(ATTENTION.names())
    with pytest.raises(RegistryError, match="unknown attention 'fa9'.*known: auto"):
        build_plan("fa9", spec_row(), CPU)


def test_auto_is_the_explicit_mask_on_cpu():
    assert isinstance(build_plan("auto", spec_row(), CPU), MaskPlan)


def test_varlen_needs_cuda():
    with pytest.raises(ValueError, match="'varlen' needs a CUDA device"):
        build_plan("varlen", spec_row(), CPU)


def test_kernels_falls_back_with_one_warning():
    _warn_fallback.cache_clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plans = [build_plan("kernels", spec_row(), CPU) for _ in range(3)]
    assert all(isinstance(plan, MaskPlan) for plan in plans)
    assert [str(w.message) for w in caught] == ["attention 'kernels': FA3 (kernels-community/vllm-flash-attn3) is "
                                                "unavailable on cpu; using 'sdpa'"]  # fmt: skip


def test_mask_and_ancestor_intervals_of_the_spec_example():
    row = spec_row()  # S0 [1 2] | S1 [3 4 5] | S2 [3 6 7]
    expected = torch.tensor([
        [1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0, 0],
        [1, 1, 0, 0, 0, 1, 0, 0],
        [1, 1, 0, 0, 0, 1, 1, 0],
        [1, 1, 0, 0, 0, 1, 1, 1],
    ], dtype=torch.bool)  # fmt: skip
    assert torch.equal(tree_attention_mask(row)[0, 0], expected)
    ends = subtree_ends(row)
    assert ends.tolist() == [8, 8, 5, 5, 5, 8, 8, 8]
    q, k = torch.arange(8)[:, None], torch.arange(8)[None, :]
    assert torch.equal((k <= q) & (q < ends[k]), expected)  # the relation the flex block mask is built from


def test_varlen_plan_gathers_paths_and_skips_the_gather_for_flat_rows():
    tree = varlen_plan(spec_row(), CPU, kernel=lambda *a: a[0])
    assert tree.cu_q.tolist() == [0, 2, 5, 8] and tree.cu_k.tolist() == [0, 2, 7, 12]
    assert (tree.max_q, tree.max_k) == (3, 5)
    assert tree.kv_gather.tolist() == [0, 1, 0, 1, 2, 3, 4, 0, 1, 5, 6, 7]
    flat = FlatRow(100)
    flat.add(make_sample([1, 2, 3], 1))
    flat.add(make_sample([1, 2, 3, 4], 1))
    plan = varlen_plan(flat.pack(0), CPU, kernel=lambda *a: a[0])
    assert isinstance(plan, VarlenPlan) and plan.kv_gather is None and plan.cu_k.tolist() == [0, 3, 7]


def test_grouped_query_attention_runs_as_one_call_per_group_without_expanding_kv():
    torch.manual_seed(0)
    q = torch.randn(6, 8, 4, requires_grad=True)  # 8 query heads over 2 K/V heads: groups of 4
    k, v = torch.randn(6, 2, 4, requires_grad=True), torch.randn(6, 2, 4, requires_grad=True)
    causal = torch.ones(6, 6, dtype=torch.bool).tril()

    def attend(query, key):
        assert query.shape[1] == key.shape[1] == 2
        out = F.scaled_dot_product_attention(query.transpose(0, 1), key.transpose(0, 1), v.transpose(0, 1),
                                             attn_mask=causal)  # fmt: skip
        return out.transpose(0, 1)

    grouped = per_kv_group(lambda group: attend(group, k), q, kv_heads=2)
    expected = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                              attn_mask=causal, enable_gqa=True).transpose(0, 1)  # fmt: skip
    torch.testing.assert_close(grouped, expected)
    grads = torch.autograd.grad(grouped.square().sum(), (q, k, v))
    for got, want in zip(grads, torch.autograd.grad(expected.square().sum(), (q, k, v)), strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("autocast", [False, True])
def test_flash_kernels_get_one_half_dtype_and_the_gather_moves_half_precision_keys(autocast):
    """Under autocast Qwen3's q/k norms give float32 beside a bf16 v; flash kernels take fp16/bf16 only, and the
    keys are cast before they are gathered along the paths (without autocast, after). The result stays half under
    autocast (the output projection casts to it anyway), else it is the query's dtype."""
    seen = []

    def kernel(q, k, v, *rest):
        seen.append(({q.dtype, k.dtype, v.dtype}, q.is_contiguous() and k.is_contiguous(), k.shape[0]))
        return q

    class Gathers(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.Tensor.index_select:
                gathered.append(args[0].dtype)
            return func(*args, **(kwargs or {}))

    plan = varlen_plan(spec_row(), CPU, kernel=kernel)
    length = spec_row().num_forwarded
    query, key = torch.randn(1, 2, length, 4), torch.randn(1, 1, length, 4)
    gathered: list[torch.dtype] = []
    with torch.autocast("cpu", dtype=torch.float16, enabled=autocast), Gathers():
        out = plan.attend(query, key, key.to(torch.bfloat16), 0.5)
    half = torch.float16 if autocast else torch.bfloat16
    assert seen == [({half}, True, plan.kv_gather.numel())]
    assert out.shape == (1, length, 2, 4) and out.dtype == (half if autocast else torch.float32)
    # autocast: gathered (and their gradients summed over paths) in half; a float32 model keeps float32 keys
    assert gathered == ([half, half] if autocast else [torch.float32, torch.bfloat16])


def test_attach_is_idempotent_and_the_model_refuses_to_run_without_a_plan():
    model = build_tiny_qwen3()
    attach_tree_attention(model)
    attach_tree_attention(model)
    assert model.config._attn_implementation == TREE_ATTENTION
    with pytest.raises(RuntimeError, match="needs a tree_plan"):
        model(input_ids=torch.tensor([[1, 2, 3]]))


def test_attach_reaches_through_a_ddp_style_wrapper():
    class Wrapper(torch.nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

    model = build_tiny_qwen3()
    attach_tree_attention(Wrapper(model))
    assert model.config._attn_implementation == TREE_ATTENTION


def tiny_config(**overrides) -> Qwen3Config:
    return Qwen3Config(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, **overrides)  # fmt: skip


def test_model_check_rejects_other_layer_types():
    model = Qwen3ForCausalLM(tiny_config())
    model.config.layer_types = ["mamba", "full_attention"]  # gated DeltaNet hybrids: tests/packing/test_deltanet.py
    with pytest.raises(ValueError, match=r"layer_types \['mamba'\].*gated DeltaNet"):
        check_model(model)


def test_model_check_rejects_layers_without_self_attention():
    model = Qwen3ForCausalLM(tiny_config())
    del model.model.layers[1].self_attn
    with pytest.raises(ValueError, match=r"decoder layers \[1\] have neither self_attn"):
        attach_tree_attention(model)


def test_model_check_takes_sliding_windows_and_rejects_attention_dropout():
    check_model(Qwen3ForCausalLM(tiny_config(use_sliding_window=True, sliding_window=4, max_window_layers=1)))
    with pytest.raises(ValueError, match="attention_dropout=0.1"):
        check_model(Qwen3ForCausalLM(tiny_config(attention_dropout=0.1)))


# ---- GPU: the fused backends, bf16, against each sample forwarded alone -------------------------------------


def _alone(model, samples):
    out = []
    for sample in samples:
        tokens = torch.tensor(sample.sequence.token_ids, device="cuda")
        logprobs = model(input_ids=tokens[None]).logits[0].float().log_softmax(-1)[:-1]
        mask = torch.tensor(sample.sequence.mask[1:], dtype=torch.bool, device="cuda")
        out.append(logprobs.gather(1, tokens[1:, None]).squeeze(1)[mask])
    return torch.cat(out)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("attention", ["varlen", "cascade", "flex", "kernels"])
def test_gpu_backends_match_per_sample_logprobs_in_bf16(attention):
    row = TreeRow(10_000)
    for sample in random_samples(seed=11):
        row.add(sample)
    packed_row = row.pack(0)
    model = build_tiny_qwen3(head_dim=64, dtype=torch.bfloat16).cuda()
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("sdpa")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = packed_forward(model, packed_row, 1.0, attention=attention)
    out.logprobs.sum().backward()
    with torch.no_grad():
        expected = _alone(reference, packed_row.samples)
    assert (out.logprobs.detach() - expected).abs().max() < 0.05
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.gpu
@needs_cuda
def test_gpu_cascade_gradients_are_as_close_to_float32_as_varlens_in_bf16():
    """Parameter gradients of a bf16 model through cascade and through varlen, each against the float32 model
    through the sdpa mask: cascade's error is within 5% of each gradient's scale and not above varlen's by more
    than bf16 noise."""
    row = TreeRow(10_000)
    for sample in random_samples(seed=11):
        row.add(sample)
    packed_row = row.pack(0)
    base = build_tiny_qwen3(head_dim=64).cuda()
    grads = {}
    for attention, dtype in (("sdpa", torch.float32), ("varlen", torch.bfloat16), ("cascade", torch.bfloat16)):
        model = copy.deepcopy(base).to(dtype)
        out = packed_forward(model, packed_row, 1.0, attention=attention)
        (packed_row.advantages.cuda() * out.logprobs).sum().backward()
        grads[attention] = {name: p.grad.float() for name, p in model.named_parameters()}
    for name, expected in grads["sdpa"].items():
        scale = expected.abs().max()
        cascade, varlen = ((grads[a][name] - expected).abs().max() for a in ("cascade", "varlen"))
        assert cascade <= 0.05 * scale and cascade <= 1.5 * varlen + 0.01 * scale, (name, cascade, varlen, scale)


def test_flex_plan_on_cpu_is_a_block_mask():
    assert isinstance(build_plan("flex", spec_row(), CPU), FlexPlan)
