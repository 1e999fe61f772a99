"""The running batch on Gemma 3's text model (sliding-window layers around a full-attention one, a window shorter than
the rows): rows joining at different steps, left-padded beside longer ones, leaving and preempted decode exactly what
each row gives alone in a plain forward; a layer type with no slot layer is still refused at startup."""

from __future__ import annotations

import pytest
import torch
from test_hybrid_batch import assert_matches_a_plain_forward, decode_with_preemptions, make_row, prompt, run_schedule
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, Llama4ForCausalLM, Llama4TextConfig

from asyncrl.engine.cache import SlackCache
from asyncrl.engine.core import Engine, EngineConfig

WINDOW = 4


@pytest.fixture(scope="module")
def gemma3() -> torch.nn.Module:
    config = Gemma3TextConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8,
                              max_position_embeddings=256, sliding_window=WINDOW,
                              layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                              pad_token_id=0, bos_token_id=None, eos_token_id=1)  # fmt: skip
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return Gemma3ForCausalLM(config).eval()


def test_sliding_window_rows_joining_leaving_and_preempted_decode_as_if_alone(gemma3):
    joins = {
        0: [make_row("a", prompt(0, 3), 9), make_row("b", prompt(1, 17), 6), make_row("c", prompt(2, 9), 12)],
        3: [make_row("d", prompt(3, 2), 10), make_row("e", prompt(4, 30), 5)],  # e pads every row by 20+ columns
    }
    run_schedule(gemma3, joins, preempt_at=7)
    assert_matches_a_plain_forward(gemma3, [row for rows in joins.values() for row in rows])


def test_sliding_window_rows_decode_through_the_engine_as_if_alone(gemma3):
    assert_matches_a_plain_forward(gemma3, decode_with_preemptions(gemma3, 4))


def test_every_attention_layer_of_a_sliding_window_model_gets_a_slack_layer(gemma3):
    assert [type(layer).__name__ for layer in SlackCache(gemma3).layers] == ["SlackLayer"] * 3


def test_a_chunked_attention_model_is_refused_naming_its_layer_type():
    config = Llama4TextConfig(vocab_size=32, hidden_size=16, intermediate_size=32, intermediate_size_mlp=32,
                              num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                              attention_chunk_size=4, num_local_experts=1, no_rope_layers=[1, 0],
                              layer_types=["chunked_attention", "full_attention"])  # fmt: skip
    engine_config = EngineConfig(max_model_len=64, max_num_seqs=2, kv_cache_tokens=64, eos_token_ids=frozenset())
    with pytest.raises(ValueError, match=r"layer 0 is 'chunked_attention'"):
        Engine(Llama4ForCausalLM(config), engine_config)
