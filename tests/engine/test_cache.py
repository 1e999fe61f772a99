"""SlackLayer: the same keys/values as concatenation, kept through growth, row writes, compaction and trimming."""

from __future__ import annotations

import inspect

import torch
from tiny import VOCAB_SIZE
from transformers import DynamicCache

from asyncrl.engine.cache import MIN_SLACK_COLUMNS, SlackCache, SlackLayer


def states(rows: int, length: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, 2, length, 4, generator=torch.Generator().manual_seed(seed))


def test_updates_past_the_capacity_keep_every_column():
    layer, chunks = SlackLayer(), []
    for step in range(MIN_SLACK_COLUMNS + 40):
        chunk = states(3, 5 if step == 0 else 1, step)
        chunks.append(chunk)
        keys, values = layer.update(chunk, -chunk)
    expected = torch.cat(chunks, dim=2)
    assert torch.equal(keys, expected) and torch.equal(values, -expected)
    assert layer.get_seq_length() == MIN_SLACK_COLUMNS + 44


def test_written_rows_are_right_aligned_and_widen_the_batch_on_the_left():
    layer = SlackLayer()
    first, longer = states(2, 6, 0), states(1, 9, 1)
    layer.write_rows([0, 1], first, first)
    layer.write_rows([3], longer, longer)  # slot 2 stays a free (zero) row
    assert layer.keys.shape == (4, 2, 9, 4)
    assert torch.equal(layer.keys[:2, :, 3:], first) and torch.equal(layer.keys[:2, :, :3], torch.zeros(2, 2, 3, 4))
    assert torch.equal(layer.keys[3], longer[0]) and torch.equal(layer.keys[2], torch.zeros(2, 9, 4))


def test_keep_rows_reorders_in_place_and_drop_columns_trims_the_left():
    layer = SlackLayer()
    rows = states(4, 7, 2)
    layer.write_rows([0, 1, 2, 3], rows, rows)
    layer.keep_rows([3, 1])
    layer.drop_columns(2)
    assert torch.equal(layer.keys, rows[[3, 1], :, 2:]) and torch.equal(layer.values, rows[[3, 1], :, 2:])
    step = states(2, 1, 3)
    keys, _ = layer.update(step, step)
    assert torch.equal(keys, torch.cat([rows[[3, 1], :, 2:], step], dim=2))


def test_decoding_with_the_slack_cache_gives_the_dynamic_cache_logits(tiny_model):
    prompt = torch.tensor([[5, 9, 3, 17, 40, 2], [7, 7, 8, 30, 11, 4]])
    argument = "cache" if "cache" in inspect.signature(tiny_model.forward).parameters else "past_key_values"
    logits = {}
    for name, cache in (("dynamic", DynamicCache(config=tiny_model.config)), ("slack", SlackCache(tiny_model))):
        input_ids, steps = prompt, []
        with torch.no_grad():
            for _ in range(MIN_SLACK_COLUMNS + 8):  # past the first reallocation
                out = tiny_model(input_ids=input_ids, use_cache=True, logits_to_keep=1, **{argument: cache})
                steps.append(out.logits[:, -1])
                input_ids = (out.logits[:, -1].argmax(-1, keepdim=True) + 3) % VOCAB_SIZE
        logits[name] = torch.stack(steps)
    torch.testing.assert_close(logits["slack"], logits["dynamic"])
