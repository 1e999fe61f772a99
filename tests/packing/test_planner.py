"""The micro-batch planner: properties over random streams, then the placement rules one by one."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st
from packing_samples import make_sample

from asyncrl.packing import FlatRow, MicroBatchPlanner, TreeRow, plan_micro_batches
from asyncrl.packing.planner import causal_pairs

PACKERS = {"flat": FlatRow, "tree": TreeRow}


@st.composite
def streams(draw):
    """Groups of rollouts sharing a prompt over a tiny vocabulary (so unrelated samples share too)."""
    samples = []
    for group in range(draw(st.integers(1, 6))):
        prompt = draw(st.lists(st.integers(2, 6), min_size=1, max_size=12))
        for rollout in range(draw(st.integers(1, 5))):
            completion = draw(st.lists(st.integers(2, 6), min_size=1, max_size=16))
            samples.append(make_sample(prompt + completion, len(prompt), group, seed=group * 10 + rollout))
    order = draw(st.permutations(range(len(samples))))
    return [samples[i] for i in order]


@settings(max_examples=150, deadline=None)
@given(
    stream=streams(),
    dp=st.integers(1, 4),
    budget=st.integers(6, 48),
    packer=st.sampled_from(sorted(PACKERS)),
)
def test_budget_placement_and_loss_slots_hold_for_any_stream(stream, dp, budget, packer):
    micro_batches, dropped = plan_micro_batches(stream, lambda: PACKERS[packer](budget), dp, budget)
    placed = Counter(id(s) for mb in micro_batches for row in mb for s in row.samples)
    oversize = [s for s in stream if s.num_tokens > budget]
    assert dropped == len(oversize)
    assert all(placed[id(s)] == (0 if s.num_tokens > budget else 1) for s in stream)
    assert sum(placed.values()) == len(stream) - dropped
    for index, micro_batch in enumerate(micro_batches):
        assert len(micro_batch) == dp
        if index < len(micro_batches) - 1:  # only the flushed last one may leave a rank empty
            assert all(row.samples for row in micro_batch)
        for row in micro_batch:
            packed = row.pack(top_k=0)
            assert row.num_tokens == packed.num_forwarded <= budget
            _assert_each_trained_token_once(packed, row.samples)


def _assert_each_trained_token_once(packed, samples):
    slots = Counter()
    for slot in range(packed.num_trained):
        sample = samples[int(packed.sequence_index[slot])]
        position = int(packed.token_index[slot])
        depth = int(packed.position_ids[position])
        assert packed.input_ids[position] == sample.sequence.token_ids[depth]
        assert packed.target_ids[slot] == sample.sequence.token_ids[depth + 1]
        slots[(int(packed.sequence_index[slot]), depth + 1)] += 1
    expected = {(s, i) for s, sample in enumerate(samples) for i, m in enumerate(sample.sequence.mask) if m}
    assert set(slots) == expected and all(count == 1 for count in slots.values())


@settings(max_examples=100, deadline=None)
@given(stream=streams(), budget=st.integers(6, 48), packer=st.sampled_from(sorted(PACKERS)))
def test_one_rank_reduces_to_closing_when_the_row_is_full(stream, budget, packer):
    expected, current = [], PACKERS[packer](budget)
    for sample in stream:
        if sample.num_tokens > budget:
            continue
        if not current.fits(sample):
            expected.append(current.samples)
            current = PACKERS[packer](budget)
        current.add(sample)
    expected.append(current.samples)
    micro_batches, _ = plan_micro_batches(stream, lambda: PACKERS[packer](budget), 1, budget)
    assert [mb[0].samples for mb in micro_batches] == [rows for rows in expected if rows]


def group(group_id: int, prompt_len: int, completion_len: int, count: int, first_token: int = 2):
    prompt = [first_token + group_id] * prompt_len
    return [make_sample(prompt + [40 + r] * completion_len, prompt_len, group_id, seed=r) for r in range(count)]


def test_a_sample_joins_the_row_that_holds_its_group():
    planner = MicroBatchPlanner(lambda: TreeRow(100), dp=2, token_budget=100)
    a, b = group(0, 10, 5, 3), group(1, 10, 5, 3)
    for sample in [a[0], b[0], a[1], b[1], a[2], b[2]]:
        assert planner.offer(sample) is None
    assert [len(row.samples) for row in planner.rows] == [3, 3]
    assert {s.group_id for s in planner.rows[0].samples} == {0}
    assert planner.rows[0].num_tokens == 9 + 3 * (1 + 5)  # the prompt once, its last token once per fork


def test_a_full_home_row_overflows_into_an_empty_rank():
    planner = MicroBatchPlanner(lambda: TreeRow(21), dp=2, token_budget=21)
    samples = group(0, 10, 5, 3)
    assert planner.offer(samples[0]) is None and planner.offer(samples[1]) is None  # 15 + (1 + 5) = 21
    assert planner.offer(samples[2]) is None
    assert [len(row.samples) for row in planner.rows] == [2, 1]


def test_overflow_that_would_raise_the_most_loaded_row_closes_the_micro_batch():
    planner = MicroBatchPlanner(lambda: TreeRow(30), dp=2, token_budget=30)
    siblings, other = group(0, 2, 8, 4), make_sample([30] * 15, 5, group_id=1)
    for sample in [siblings[0], other, siblings[1], siblings[2]]:  # row 0: 10 + 9 + 9 = 28 tokens
        assert planner.offer(sample) is None
    assert planner.loads == [causal_pairs(10) + 2 * (causal_pairs(10) - causal_pairs(1)), causal_pairs(15)]
    closed = planner.offer(siblings[3])  # row 1 has room (15 + 10), but its load would pass row 0's 163
    assert closed is not None and [len(row.samples) for row in closed] == [3, 1]
    assert planner.rows[0].samples == [siblings[3]]


def test_overflow_that_keeps_the_maximum_goes_to_the_lighter_row():
    planner = MicroBatchPlanner(lambda: FlatRow(40), dp=2, token_budget=40)
    heavy = [make_sample([2] * 20, 10, group_id=0, seed=i) for i in range(2)]
    light = make_sample([3] * 4, 2, group_id=1)
    for sample in [heavy[0], light, heavy[1]]:
        planner.offer(sample)
    assert [len(row.samples) for row in planner.rows] == [2, 1]
    third = make_sample([2] * 6, 3, group_id=0, seed=9)  # row 0 is full; row 1 at 4 + 6 stays under row 0's load
    assert planner.offer(third) is None
    assert planner.rows[1].samples == [light, third]
    assert planner.loads == [2 * causal_pairs(20), causal_pairs(4) + causal_pairs(6)]


def test_oversize_samples_are_dropped_and_counted():
    planner = MicroBatchPlanner(lambda: TreeRow(8), dp=1, token_budget=8)
    assert planner.offer(make_sample([2] * 9, 1)) is None
    assert planner.dropped_oversize == 1 and planner.flush() is None


def test_load_counts_only_the_attention_of_novel_tokens():
    assert causal_pairs(4) == 1 + 2 + 3 + 4
    assert causal_pairs(4, shared=2) == 3 + 4
