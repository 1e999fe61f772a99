"""Model FLOPs from the config against the parameters of real (tiny) modules, causal pairs of packed rows, and
when MFU is logged."""

from __future__ import annotations

import time

import pytest
import torch

from asyncrl.assets.model_families import build_model, hybrid_text_config, moe_config
from asyncrl.assets.tiny_model import build_config, build_tokenizer
from asyncrl.packing import PACKERS
from asyncrl.rollout.types import RolloutSample, TrainingSequence
from asyncrl.trainer.flops import MfuMeter, forward_flops, peak_tflops, row_flops, row_pairs

TOKENIZER = build_tokenizer()


def linear_params(model: torch.nn.Module, skip: tuple[str, ...] = ()) -> int:
    """Weights of the decoder's linear layers (the LM head excluded): a forward's multiply-adds per token."""
    linear = [(name, m) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and name != "lm_head"]
    return sum(m.weight.numel() for name, m in linear if not any(part in name for part in skip))


def test_a_dense_forward_is_two_flops_per_linear_weight_per_token_plus_the_lm_head():
    config = build_config(TOKENIZER)
    model = build_model(config, TOKENIZER)
    assert forward_flops(config, 10, 0, 0) == 2 * linear_params(model) * 10
    assert forward_flops(config, 0, 3, 0) == 2 * config.hidden_size * config.vocab_size * 3


def test_attention_pairs_cost_four_flops_per_head_dimension_per_layer():
    config = build_config(TOKENIZER)
    per_pair = 4 * config.num_attention_heads * config.head_dim * config.num_hidden_layers
    assert forward_flops(config, 0, 0, 7) == per_pair * 7


def test_a_mixture_of_experts_counts_the_router_and_the_routed_experts_only():
    config = moe_config(TOKENIZER)
    model = build_model(config, TOKENIZER)
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    routers = sum(p.numel() for name, p in model.named_parameters() if name.endswith("mlp.gate.weight"))
    active = linear_params(model, skip=(".experts.", "mlp.gate")) + routers
    active += experts * config.num_experts_per_tok // config.num_experts
    assert forward_flops(config, 4, 0, 0) == 2 * active * 4


def test_a_gated_deltanet_hybrid_counts_its_projections_and_state_updates():
    config = hybrid_text_config(TOKENIZER)
    model = build_model(config, TOKENIZER)
    linear_layers = config.layer_types.count("linear_attention")
    state = 4 * config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim
    assert forward_flops(config, 5, 0, 0) == (2 * linear_params(model) + state * linear_layers) * 5


def gemma3_config(window: int):
    """Gemma 3's text model: two sliding-window layers around a full-attention one, grouped-query attention with a
    head size of its own."""
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(vocab_size=len(TOKENIZER), hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=window,
                            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                            pad_token_id=0)  # fmt: skip


def test_gemma3_counts_its_linear_layers_and_its_sliding_layers_window_pairs():
    config = gemma3_config(window=3)
    model = build_model(config, TOKENIZER)
    per_pair = 4 * config.num_attention_heads * config.head_dim
    assert forward_flops(config, 6, 0, 0) == 2 * linear_params(model) * 6
    assert forward_flops(config, 0, 0, 10, window_pairs=4) == per_pair * (10 + 2 * 4)
    assert MfuMeter.for_run(config, 2.0, torch.device("cpu"), "fp32", devices=1) is not None


def sample(completion: list[int]) -> RolloutSample:
    tokens = [5, 6, 7, 8, *completion]
    seq = TrainingSequence(tokens, [0] * 4 + [1] * len(completion), [0.0] * len(tokens))
    return RolloutSample(seq, advantage=1.0, reward=1.0, group_id=0, row_index=0, prompt_index=0, model_version=0,
                         rollout_id="r", queued_at=time.time())  # fmt: skip


@pytest.mark.parametrize("packing", ["flat", "tree"])
def test_a_row_costs_its_causal_pairs_once_and_logits_where_tokens_train(packing):
    """Two completions sharing a 4-token prompt: flat forwards each sample whole; the tree forwards the first
    whole, then the second's branch (from its last prompt token, whose logit predicts its first completion token)
    attending to the 3 shared tokens before it."""
    config = build_config(TOKENIZER)
    factory, _ = PACKERS.build({"name": packing}).rows(64)
    row = factory()
    for completion in ([9, 10], [11, 12, 13]):
        row.add(sample(completion))
    packed = row.pack(0)
    flat_pairs = 6 * 7 // 2 + 7 * 8 // 2
    tree_pairs = 6 * 7 // 2 + (4 * 3 + 4 * 5 // 2)
    assert row_pairs(packed) == (flat_pairs if packing == "flat" else tree_pairs)
    trained_positions = 5  # the 2 + 3 completion tokens, predicted from the positions before each
    expected = 3 * forward_flops(config, packed.num_forwarded, trained_positions, row_pairs(packed))
    assert row_flops(config, packed) == expected


def test_a_sliding_window_caps_each_querys_keys():
    """One 9-token sample (4 prompt, 5 completion tokens) with a window of 3: its queries see 1, 2, 3, 3, ... keys;
    the tree's second branch (4 queries after 3 shared keys) sees 3 each; no window: the causal pairs."""
    factory, _ = PACKERS.build({"name": "tree"}).rows(64)
    row = factory()
    row.add(sample([9, 10, 11, 12, 13]))
    row.add(sample([14, 15, 16]))
    packed = row.pack(0)
    assert row_pairs(packed, window=3) == (1 + 2 + 3 * 7) + 3 * 4
    assert row_pairs(packed, window=100) == row_pairs(packed) == 9 * 10 // 2 + (4 * 3 + 4 * 5 // 2)
    config = gemma3_config(window=3)
    logits = int(packed.token_index.unique().numel())
    expected = 3 * forward_flops(config, packed.num_forwarded, logits, row_pairs(packed), row_pairs(packed, 3))
    assert row_flops(config, packed) == expected


def test_mfu_is_omitted_without_a_known_peak_or_architecture():
    config = build_config(TOKENIZER)
    cpu = torch.device("cpu")
    assert peak_tflops(cpu, "bf16") is None
    assert MfuMeter.for_run(config, None, cpu, "bf16", devices=1) is None
    meter = MfuMeter.for_run(config, 2.0, cpu, "fp32", devices=4)  # trainer.peak_tflops set: any device
    assert meter is not None and meter.mfu(8e12, 2.0) == pytest.approx(0.5)
    unknown = build_config(TOKENIZER)
    unknown.model_type = "gpt2"
    assert MfuMeter.for_run(unknown, 2.0, cpu, "fp32", devices=1) is None
