from __future__ import annotations

import re

import pytest
from math_verify import parse, verify

from asyncrl.assets import asset_path
from asyncrl.assets.arithmetic import (
    build_splits,
    extract_answer,
    is_correct,
    read_rows,
    split_pairs,
    write_splits,
)

QUESTION = re.compile(r"What is (\d+) \+ (\d+)\?")


def test_splits_are_fixed_by_seed():
    assert build_splits(seed=3, n_train=50, n_eval=20) == build_splits(seed=3, n_train=50, n_eval=20)
    assert build_splits(seed=3, n_train=50, n_eval=20) != build_splits(seed=4, n_train=50, n_eval=20)


def test_eval_pairs_are_held_out_of_train():
    train_pairs, eval_pairs = split_pairs(seed=0, n_eval=1000)
    assert len(eval_pairs) == 1000
    assert len(train_pairs) + len(eval_pairs) == 100 * 100
    assert not set(train_pairs) & set(eval_pairs)


def test_rows_have_deepmath_shape_and_right_solution():
    rows = build_splits(seed=0, n_train=200, n_eval=100)
    for row in rows["train"] + rows["eval"]:
        assert set(row) == {"prompt", "solution"}
        [message] = row["prompt"]
        assert message["role"] == "user"
        a, b = map(int, QUESTION.fullmatch(message["content"]).groups())
        assert row["solution"] == str(a + b)


@pytest.mark.parametrize(("n_train", "n_eval"), [(10, 0), (10, 10_000), (9_001, 1000), (0, 10)])
def test_impossible_sizes_name_the_argument(n_train, n_eval):
    with pytest.raises(ValueError, match="n_eval|n_train"):
        build_splits(seed=0, n_train=n_train, n_eval=n_eval)


def test_write_splits_round_trips(tmp_path):
    paths = write_splits(tmp_path / "arith", seed=1, n_train=30, n_eval=10)
    expected = build_splits(seed=1, n_train=30, n_eval=10)
    assert {split: read_rows(path) for split, path in paths.items()} == expected


def test_shipped_splits_are_the_generator_output():
    shipped = {split: read_rows(asset_path("arith") / f"{split}.jsonl") for split in ("train", "eval")}
    assert shipped == build_splits(seed=0, n_train=4000, n_eval=1000)


@pytest.mark.parametrize(
    ("completion", "answer"),
    [("\\boxed{85}", "85"), ("37+48=\\boxed{84} no, \\boxed{85}", "85"), ("85", None), ("\\boxed{}", "")],
)
def test_extract_answer_reads_last_boxed(completion, answer):
    assert extract_answer(completion) == answer


@pytest.mark.parametrize("completion", ["\\boxed{85}", "\\boxed{84}", "\\boxed{185}", "\\boxed{8}5", "x \\boxed{ 85 }"])
def test_is_correct_agrees_with_math_verify(completion):
    # The RL reward scores boxed answers with math-verify; the pretraining eval must give the same verdicts.
    assert is_correct(completion, "85") == verify(parse("85"), parse(completion))


def test_unboxed_answer_is_wrong():
    # The accuracy reward reads only the last \boxed{}, so a bare number earns nothing.
    assert not is_correct("85", "85")
