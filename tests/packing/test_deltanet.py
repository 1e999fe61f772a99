"""Gated-DeltaNet hybrids on packed rows (packing/deltanet.py): every trained token's log-probability and the
parameter gradients equal each sample forwarded alone by transformers' own layers, in float32 on CPU.

The rows cover what can go wrong: forks inside the convolution window (segments shorter than its width), single
token segments, identical completions, deep tries (forking multi-turn samples), flat rows; and a control that
fails when a segment starts from zeros instead of its parent's final state, so the comparison can tell.
"""

from __future__ import annotations

import copy

import pytest
import torch
from packing_samples import build_tiny_hybrid, make_sample, random_samples
from test_exactness import TEMPERATURE, alone_logprobs, assert_gradients_match, pack

from asyncrl.packing import FlatRow, deltanet
from asyncrl.packing.attention import check_model
from asyncrl.packing.deltanet import build_recurrent_plan
from asyncrl.trainer import forward
from asyncrl.trainer.forward import packed_forward


def hybrid_pair(seed: int, vision: bool = False):
    model = build_tiny_hybrid(seed, vision)
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("sdpa")
    return model, reference


def assert_exact(row, model, reference, gradients: bool = True) -> None:
    packed = packed_forward(model, row, TEMPERATURE, attention="sdpa").logprobs
    expected = alone_logprobs(reference, row.samples)
    torch.testing.assert_close(packed, expected, atol=1e-5, rtol=0)
    if gradients:
        (row.advantages * packed).sum().backward()
        (row.advantages * expected).sum().backward()
        assert_gradients_match(model, reference)


def edge_samples() -> list:
    """A prompt with: completions forking after 1 and 2 shared tokens (inside the width-4 window), two identical
    completions, one-token completions (one-token segments), and a multi-turn sample forking inside a completion."""
    prompt = [5, 6, 7, 8, 9, 10]
    completions = [[11, 12, 13, 14], [11, 15, 16], [11, 12, 17, 18, 19], [20, 21], [20, 21], [22], [23]]
    samples = [make_sample(prompt + c, len(prompt), 0, 0.3 * i - 1.0, i) for i, c in enumerate(completions)]
    turn = prompt + completions[0][:2] + [24, 25, 26]
    samples.append(make_sample(turn, len(prompt) + 2, 0, 0.7, 99))
    samples.append(make_sample([30], 0, 1, 0.5, 100))  # a one-token sample: nothing trained, still a segment
    samples.append(make_sample([31, 32, 33], 1, 2, -0.5, 101))  # shorter than the window, alone in its trie
    return samples


@pytest.mark.parametrize("seed", [0, 1])
def test_tree_rows_match_each_sample_alone(seed):
    row = pack(random_samples(seed, num_groups=2, max_group=4))
    assert row.num_forwarded < row.num_raw_tokens
    assert_exact(row, *hybrid_pair(seed))


def test_edge_cases_of_the_window_and_the_trie():
    row = pack(edge_samples())
    plan = build_recurrent_plan(row, kernel_size=4, device=torch.device("cpu"))
    assert len(plan.levels) >= 3  # prompt, the shared first completion token, forks below it
    assert min(seg.q_end - seg.q_start for seg in row.segments) == 1
    assert_exact(row, *hybrid_pair(2))


def test_flat_rows_start_every_sample_fresh():
    row = pack(random_samples(3, num_groups=2, max_group=3), FlatRow)
    assert_exact(row, *hybrid_pair(3))


def test_a_vision_language_checkpoint_packs_its_text_model():
    row = pack(random_samples(4, num_groups=2, max_group=4))
    assert_exact(row, *hybrid_pair(4, vision=True), gradients=False)


def test_segments_started_from_zeros_are_caught(monkeypatch):
    """Control: forget the parents' final states and the comparison fails."""
    row = pack(edge_samples())
    model, reference = hybrid_pair(5)

    def orphaned(row, kernel_size, device):
        plan = build_recurrent_plan(row, kernel_size, device)
        for level in plan.levels[1:]:
            level.parents = None
        return plan

    monkeypatch.setattr(forward, "build_recurrent_plan", orphaned)
    packed = packed_forward(model, row, TEMPERATURE, attention="sdpa").logprobs
    assert (packed - alone_logprobs(reference, row.samples)).abs().max() > 1e-3


def test_gradient_checkpointing_keeps_the_plan():
    row = pack(edge_samples())
    model, _ = hybrid_pair(6)
    plain = copy.deepcopy(model)
    model.gradient_checkpointing_enable()
    (row.advantages * packed_forward(model, row, TEMPERATURE, attention="sdpa").logprobs).sum().backward()
    (row.advantages * packed_forward(plain, row, TEMPERATURE, attention="sdpa").logprobs).sum().backward()
    assert_gradients_match(model, plain, rtol=1e-5)


def test_other_token_mixers_and_attention_sinks_are_refused():
    from transformers import GptOssConfig, GptOssForCausalLM, Lfm2Config, Lfm2ForCausalLM

    sinks = GptOssForCausalLM(GptOssConfig(vocab_size=48, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                           num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                           num_local_experts=2, num_experts_per_tok=1,
                                           layer_types=["full_attention"]))  # fmt: skip
    with pytest.raises(ValueError, match="attention sinks"):
        check_model(sinks)
    conv = Lfm2ForCausalLM(Lfm2Config(vocab_size=48, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1,
                                      layer_types=["conv", "full_attention"]))  # fmt: skip
    with pytest.raises(ValueError, match=r"\['conv'\]"):
        check_model(conv)


# ---- GPU: fla's varlen kernel against transformers' reference, both ways through a packed row --------------------

needs_fla = pytest.mark.skipif(not torch.cuda.is_available() or deltanet.fla_unusable() is not None,
                               reason="needs a CUDA GPU and fla that trains there (deltanet.fla_unusable)")  # fmt: skip


@pytest.mark.gpu
@needs_fla
def test_fla_levels_match_the_torch_reference_on_cuda(monkeypatch):
    """The same tree row through fla's kernels (the varlen recurrence and the convolution) and through transformers'
    reference (fla hidden), in float32: log-probabilities and gradients agree to the kernels' rounding (fla's
    chunked solve differs in order)."""
    row = pack(edge_samples() + random_samples(12, num_groups=2, max_group=4))
    model = build_tiny_hybrid(7).cuda()
    reference = copy.deepcopy(model)
    fla_out = packed_forward(model, row, TEMPERATURE, attention="sdpa").logprobs
    (row.advantages.cuda() * fla_out).sum().backward()
    monkeypatch.setattr(deltanet, "_fla_rule", lambda: None)
    monkeypatch.setattr(deltanet, "_fla_conv", lambda: None)
    torch_out = packed_forward(reference, row, TEMPERATURE, attention="sdpa").logprobs
    (row.advantages.cuda() * torch_out).sum().backward()
    torch.testing.assert_close(fla_out, torch_out, atol=2e-3, rtol=0)
    assert_gradients_match(model, reference, rtol=2e-2)
