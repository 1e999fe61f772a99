"""The running batch on a gated-DeltaNet hybrid (Qwen3.5, text and vision-language): rows joining at different
steps, leaving, taking freed slots and being preempted decode exactly what each row gives alone in a plain forward."""

from __future__ import annotations

import pytest
import torch

from asyncrl.assets.model_families import build_model, hybrid_text_config
from asyncrl.assets.tiny_model import build_tokenizer
from asyncrl.assets.tiny_vlm import build_vlm_config, build_vlm_tokenizer
from asyncrl.engine.batch import RunningBatch
from asyncrl.engine.cache import SlackCache, StateLayer
from asyncrl.engine.core import Engine, EngineConfig
from asyncrl.engine.lora import AdapterSet, LoraLimits
from asyncrl.engine.rows import DecodeRow, GenerationRequest
from asyncrl.sampling import SamplingParams

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def hybrid(tokenizer) -> torch.nn.Module:
    return build_model(hybrid_text_config(tokenizer), tokenizer).eval()


@pytest.fixture(scope="module")
def hybrid_vlm() -> torch.nn.Module:
    tokenizer = build_vlm_tokenizer()
    return build_model(build_vlm_config(tokenizer), tokenizer, seed=1).eval()


def prompt(seed: int, length: int) -> list[int]:
    return torch.randint(7, 100, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def make_row(name: str, tokens: list[int], max_tokens: int) -> DecodeRow:
    request = GenerationRequest(name, tokens, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return DecodeRow(request, torch.Generator())


def assert_matches_a_plain_forward(model: torch.nn.Module, rows: list[DecodeRow]) -> None:
    """Each row's tokens are greedy and its logprobs are those of one unpadded, uncached forward of its tokens."""
    for row in rows:
        prompt_ids, output = row.request.prompt_ids, row.output_ids
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt_ids + output])).logits[0].double()
        logprobs = logits[len(prompt_ids) - 1 : -1].log_softmax(-1)
        chosen = logprobs.gather(1, torch.tensor(output).unsqueeze(1)).squeeze(1)
        assert len(output) == row.request.params.max_tokens, row.request.request_id
        torch.testing.assert_close(torch.tensor(row.logprobs, dtype=torch.float64), chosen, atol=TOLERANCE, rtol=0)
        assert bool((chosen >= logprobs.max(-1).values - TOLERANCE).all()), f"{row.request.request_id} not greedy"


def run_schedule(model: torch.nn.Module, joins: dict[int, list[DecodeRow]], preempt_at: int) -> set[int]:
    """Decode greedily, rows joining at their step and leaving at max_tokens; at ``preempt_at`` every row loses
    its cache and is re-prefilled from its tokens. Returns the number of slots seen per step (free ones included)."""
    batch, step, slot_counts = RunningBatch(model), 0, set()
    with torch.inference_mode():
        while step <= max(joins) or batch.rows:
            joining = (batch.clear() if step == preempt_at else []) + joins.get(step, [])
            parts = [batch.decode()] if batch.rows else []
            if joining:
                parts.append(batch.join(joining))
            for row, logprobs in zip(batch.rows, torch.cat(parts).log_softmax(-1), strict=True):
                token = int(logprobs.argmax())
                row.output_ids.append(token)
                row.logprobs.append(float(logprobs[token]))
            batch.remove([row for row in batch.rows if len(row.output_ids) >= row.request.params.max_tokens])
            slot_counts.add(len(batch._slots))
            step += 1
    return slot_counts


def test_rows_joining_leaving_and_preempted_decode_as_if_alone(hybrid):
    group = prompt(5, 6)
    joins = {
        0: [make_row("a", prompt(0, 5), 4), make_row("b", prompt(1, 17), 14), make_row("e", prompt(2, 9), 12)],
        2: [make_row("c", prompt(3, 3), 10), make_row("g1", group, 8), make_row("g2", group, 11)],
        # a's slot is decoded as a free dummy at steps 4-5 before d takes it; d (70 tokens) widens every row past
        # the delta rule's 64-token chunk and pads c by 67 positions.
        6: [make_row("d", prompt(4, 70), 6)],
    }
    slot_counts = run_schedule(hybrid, joins, preempt_at=9)
    assert_matches_a_plain_forward(hybrid, [row for rows in joins.values() for row in rows])
    assert 6 in slot_counts and 2 in slot_counts  # free slots were decoded, and the batch compacted


def test_left_padding_leaves_the_delta_net_states_of_a_fresh_prefill(hybrid):
    """The states a short row gets when prefilled left-padded next to a long one equal its states alone."""
    short, long = prompt(0, 3), prompt(1, 70)
    caches = {}
    with torch.inference_mode():
        for name, rows in (("padded", [make_row("s", short, 1), make_row("l", long, 1)]),
                           ("alone", [make_row("s", short, 1)])):  # fmt: skip
            batch = RunningBatch(hybrid)
            batch.join(rows)
            caches[name] = batch._cache
    for padded, alone in zip(caches["padded"].layers, caches["alone"].layers, strict=True):
        if isinstance(alone, StateLayer):
            torch.testing.assert_close(padded.conv_states[0][:1], alone.conv_states[0], atol=1e-6, rtol=0)
            torch.testing.assert_close(padded.recurrent_states[0][:1], alone.recurrent_states[0], atol=1e-6, rtol=0)


def greedy_request(name: str, tokens: list[int], max_tokens: int, adapter: str | None = None) -> GenerationRequest:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return GenerationRequest(name, tokens, params, adapter=adapter)


def generate(engine: Engine, requests: list[GenerationRequest]) -> list[DecodeRow]:
    """Submit every request at once to the started engine; each row carries its result's tokens and logprobs."""
    results = [future.result(timeout=120) for future in [engine.submit(request) for request in requests]]
    rows = [make_row(request.request_id, request.prompt_ids, request.params.max_tokens) for request in requests]
    for row, result in zip(rows, results, strict=True):
        row.output_ids, row.logprobs = result.token_ids, result.logprobs
    return rows


def decode_with_preemptions(model: torch.nn.Module, count: int) -> list[DecodeRow]:
    """``count`` greedy rows of 25+ prompt tokens through an engine with room for two rows, whose growth past the KV
    budget forces preemptions."""
    eos = frozenset({model.generation_config.eos_token_id})
    engine = Engine(model, EngineConfig(max_model_len=64, max_num_seqs=2, kv_cache_tokens=64, eos_token_ids=eos))
    engine.start()
    try:
        rows = generate(engine, [greedy_request(f"r{i}", prompt(10 + i, 25 + 3 * i), 8 + i) for i in range(count)])
        assert engine.stats().preemptions_total > 0
    finally:
        engine.stop()
    return rows


def test_the_vision_language_model_decodes_through_the_engine_as_if_alone(hybrid_vlm):
    assert_matches_a_plain_forward(hybrid_vlm, decode_with_preemptions(hybrid_vlm, 5))


def test_lora_and_base_rows_decode_together_as_if_alone(tokenizer, tmp_path):
    """peft's mixed-batch forward over the hybrid: adapter rows and base rows in one batch, each as if alone."""
    from peft import LoraConfig, get_peft_model

    config = hybrid_text_config(tokenizer)
    lora = LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)
    adapted = get_peft_model(build_model(config, tokenizer), lora)
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.2)
    adapted.save_pretrained(tmp_path / "a")
    eos = frozenset({tokenizer.eos_token_id})
    engine = Engine(build_model(config, tokenizer).eval(), EngineConfig(64, 4, 256, eos),
                    AdapterSet(LoraLimits(max_loras=1, max_lora_rank=8), "base"))  # fmt: skip
    engine.load_adapter("a", str(tmp_path / "a"))
    engine.start()
    try:
        requests = [greedy_request(f"r{i}", prompt(20 + i, 5 + 4 * i), 6, "a" if i % 2 else None) for i in range(4)]
        rows = generate(engine, requests)
    finally:
        engine.stop()
    base = build_model(config, tokenizer).eval()
    for request, row in zip(requests, rows, strict=True):
        assert_matches_a_plain_forward(adapted.eval() if request.adapter else base, [row])


def test_the_cache_holds_state_layers_for_the_delta_net_and_slack_layers_for_attention(hybrid):
    layers = SlackCache(hybrid).layers
    assert [type(layer).__name__ for layer in layers] == ["StateLayer"] * 3 + ["SlackLayer"]
