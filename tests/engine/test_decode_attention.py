"""Grouped decode attention: the logits of transformers' SDPA, with query heads folded instead of KV copied."""

from __future__ import annotations

import inspect

import torch
from tiny import build_tiny_model
from transformers import DynamicCache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from asyncrl.engine import attention
from asyncrl.engine.attention import use_grouped_decode_attention


def decode_logits(model: torch.nn.Module, steps: int = 6) -> torch.Tensor:
    """Greedy decoding of two rows, the first left-padded, with an explicit mask and positions."""
    argument = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    input_ids = torch.tensor([[0, 0, 5, 9, 3], [4, 7, 8, 30, 11]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    cache, logits = DynamicCache(config=model.config), []
    with torch.no_grad():
        for _ in range(steps):
            out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                        logits_to_keep=1, **{argument: cache})  # fmt: skip
            logits.append(out.logits[:, -1])
            input_ids = out.logits[:, -1].argmax(-1, keepdim=True)
            mask, positions = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1), positions[:, -1:] + 1
    return torch.stack(logits)


def test_grouped_decode_attention_gives_the_sdpa_logits(monkeypatch):
    expected = decode_logits(build_tiny_model())
    model = build_tiny_model()
    use_grouped_decode_attention(model)
    delegated = []

    def counting_sdpa(module, query, *args, **kwargs):
        delegated.append(query.shape[2])
        return sdpa_attention_forward(module, query, *args, **kwargs)

    monkeypatch.setattr(attention, "sdpa_attention_forward", counting_sdpa)
    torch.testing.assert_close(decode_logits(model), expected)
    assert model.config._attn_implementation == attention.GROUPED_DECODE
    assert delegated == [5] * model.config.num_hidden_layers  # only the prefill went to transformers' SDPA
