"""TreeRow: the trie keyed on (token, next token), novel-token pricing, and the depth-first layout."""

from __future__ import annotations

import torch
from packing_samples import make_sample, random_samples

from asyncrl.packing.trie import TreeRow

P1, P2, P3, A1, A2, B1, B2 = 11, 12, 13, 21, 22, 31, 32


def spec_row() -> TreeRow:
    """The spec's example: two rollouts of prompt p1 p2 p3 with completions a1 a2 and b1 b2."""
    row = TreeRow(token_budget=100)
    row.add(make_sample([P1, P2, P3, A1, A2], prompt_len=3))
    row.add(make_sample([P1, P2, P3, B1, B2], prompt_len=3))
    return row


def test_spec_example_layout_segments_and_loss_positions():
    packed = spec_row().pack(top_k=0)
    assert packed.input_ids.tolist() == [P1, P2, P3, A1, A2, P3, B1, B2]  # p3 is not shared: it predicts a1 or b1
    assert packed.position_ids.tolist() == [0, 1, 2, 3, 4, 2, 3, 4]
    assert [(s.q_start, s.q_end, s.kv_index.tolist()) for s in packed.segments] == [
        (0, 2, [0, 1]),
        (2, 5, [0, 1, 2, 3, 4]),
        (5, 8, [0, 1, 5, 6, 7]),
    ]
    assert packed.token_index.tolist() == [2, 3, 5, 6]
    assert packed.target_ids.tolist() == [A1, A2, B1, B2]
    assert packed.sequence_index.tolist() == [0, 0, 1, 1]


def test_fits_prices_a_sample_by_its_novel_tokens():
    row = TreeRow(token_budget=8)
    row.add(make_sample([P1, P2, P3, A1, A2], prompt_len=3))
    sibling = make_sample([P1, P2, P3, B1, B2], prompt_len=3)  # 5 raw tokens, 3 novel: p3 b1 b2
    stranger = make_sample([B1, B2, A1, A2], prompt_len=1)  # 4 novel tokens
    assert row.shared_prefix(sibling) == 2 and row.fits(sibling)
    assert row.shared_prefix(stranger) == 0 and not row.fits(stranger)
    row.add(sibling)
    assert row.num_tokens == 8 == row.pack(0).num_forwarded
    assert row.pack(0).num_raw_tokens == 10


def test_identical_samples_share_every_token_and_keep_their_own_loss_slots():
    row = TreeRow(token_budget=100)
    first = make_sample([P1, P2, A1, A2], prompt_len=2, seed=1)
    twin = make_sample([P1, P2, A1, A2], prompt_len=2, seed=2)
    row.add(first)
    assert row.fits(twin) and row.shared_prefix(twin) == 4
    row.add(twin)
    packed = row.pack(0)
    assert packed.num_forwarded == 4
    assert packed.token_index.tolist() == [1, 2, 1, 2]
    expected = first.sequence.sampler_logprobs[2:] + twin.sequence.sampler_logprobs[2:]
    torch.testing.assert_close(packed.sampler_logprobs, torch.tensor(expected))


def test_a_sample_that_continues_past_another_claims_its_last_token():
    row = TreeRow(token_budget=100)
    row.add(make_sample([P1, P2, A1], prompt_len=1))
    longer = make_sample([P1, P2, A1, A2, B1], prompt_len=1)
    assert row.shared_prefix(longer) == 3  # a1 predicted nothing, so it now predicts a2
    row.add(longer)
    packed = row.pack(0)
    assert packed.input_ids.tolist() == [P1, P2, A1, A2, B1]
    assert len(packed.segments) == 1
    assert packed.token_index.tolist() == [0, 1, 0, 1, 2, 3]


def test_a_shorter_sample_ends_on_any_node_of_its_last_token():
    row = TreeRow(token_budget=100)
    row.add(make_sample([P1, P2, A1, A2], prompt_len=1))
    prefix = make_sample([P1, P2, A1], prompt_len=1)
    assert row.shared_prefix(prefix) == 3
    row.add(prefix)
    assert row.num_tokens == 4


def test_system_prefix_shared_across_groups_and_a_multi_turn_fork():
    row = TreeRow(token_budget=100)
    system = [1, 2, 3]
    row.add(make_sample(system + [10, 11, 40, 41], prompt_len=5, group_id=0))
    row.add(make_sample(system + [20, 21, 50, 51], prompt_len=5, group_id=1))
    row.add(make_sample(system + [10, 11, 40, 42, 43], prompt_len=6, group_id=0))  # forks after 40
    packed = row.pack(0)
    paths = [s.kv_index.tolist() for s in packed.segments]
    assert paths[0] == [0, 1]  # the system prefix up to the token before the fork, shared by everything
    assert packed.num_forwarded == row.num_tokens == 7 + 5 + 3  # 1 2 shared by all; 3 10 11 by group 0
    for seg in packed.segments:  # every path starts at the root and ends with the segment itself
        assert seg.kv_index[0] == 0
        assert seg.kv_index[-(seg.q_end - seg.q_start) :].tolist() == list(range(seg.q_start, seg.q_end))


def test_layout_reproduces_every_sample_along_its_path():
    samples = random_samples(seed=3)
    row = TreeRow(token_budget=10_000)
    for sample in samples:
        row.add(sample)
    packed = row.pack(top_k=2)
    for slot in range(packed.num_trained):
        sample = samples[int(packed.sequence_index[slot])]
        position = int(packed.token_index[slot])
        depth = int(packed.position_ids[position])
        assert packed.input_ids[position] == sample.sequence.token_ids[depth]
        assert packed.target_ids[slot] == sample.sequence.token_ids[depth + 1]
        assert sample.sequence.mask[depth + 1] == 1
    assert packed.num_trained == sum(s.num_trained for s in samples)
    assert packed.top_ids is not None and packed.top_ids.shape == (packed.num_trained, 2)


def test_a_long_chain_packs_without_recursion():
    row = TreeRow(token_budget=50_000)
    tokens = [i % 40 + 2 for i in range(20_000)]
    row.add(make_sample(tokens, prompt_len=10))
    packed = row.pack(0)
    assert len(packed.segments) == 1 and packed.num_trained == 19_990
