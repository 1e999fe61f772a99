"""Single- and multi-turn reconciliation: every generated token trained exactly once."""

from asyncrl.rollout.reconcile import drift, reconcile
from asyncrl.rollout.types import TurnRecord


def test_single_turn_prompt_is_context_and_output_is_trained():
    (seq,) = reconcile([TurnRecord([5, 6, 7], [8, 9], [-0.1, -0.2])])
    assert seq.token_ids == [5, 6, 7, 8, 9]
    assert seq.mask == [0, 0, 0, 1, 1]
    assert seq.sampler_logprobs == [0.0, 0.0, 0.0, -0.1, -0.2]


def test_a_turn_extending_the_held_tokens_continues_the_sequence():
    turns = [TurnRecord([1, 2], [3, 4], [-1.0, -1.0]), TurnRecord([1, 2, 3, 4, 10, 11], [5], [-0.5])]
    (seq,) = reconcile(turns)
    assert seq.token_ids == [1, 2, 3, 4, 10, 11, 5]
    assert seq.mask == [0, 0, 1, 1, 0, 0, 1]


def test_a_turn_that_rewrites_history_forks_a_new_sequence():
    turns = [TurnRecord([1, 2], [3, 4], [-1.0, -1.0]), TurnRecord([1, 2, 3, 99, 10], [5], [-0.5])]
    first, second = reconcile(turns)
    assert first.mask == [0, 0, 1, 1] and second.mask == [0, 0, 0, 0, 0, 1]
    assert sum(first.mask) + sum(second.mask) == 3  # every generated token trained once


def test_output_mask_and_sequences_without_trained_tokens():
    assert reconcile([TurnRecord([1], [2, 3], [], output_mask=[0, 0])]) == []


def _turns(*pairs):
    return [TurnRecord(list(p), list(o), [-0.1] * len(o)) for p, o in pairs]


def test_clean_append_has_no_drift():
    turns = _turns(([1, 2], [3, 4]), ([1, 2, 3, 4, 7], [5]), ([1, 2, 3, 4, 7, 5, 8], [6]))
    assert len(reconcile(turns)) == 1 and drift(turns) == [0, 0]


def test_small_drift_inside_the_last_answer_forks_with_its_size():
    turns = _turns(([1, 2], [3, 4, 5]), ([1, 2, 3, 9, 9, 7], [6]))
    first, second = reconcile(turns)
    assert drift(turns) == [2] and first.num_trained + second.num_trained == 4


def test_drift_before_the_last_answer_counts_every_held_token_after_it():
    turns = _turns(([1, 2, 3], [4]), ([1, 9, 3, 4, 5], [6]))
    assert drift(turns) == [3] and [s.num_trained for s in reconcile(turns)] == [1, 1]


def test_long_drift_then_a_short_turn_still_trains_each_token_once():
    turns = _turns(([1], list(range(10, 40))), ([1, 99, 5], [7]), ([1, 99, 5, 7, 8], [9]))
    sequences = reconcile(turns)
    assert drift(turns) == [30, 0] and [s.num_trained for s in sequences] == [30, 2]
    assert sequences[1].token_ids == [1, 99, 5, 7, 8, 9]
