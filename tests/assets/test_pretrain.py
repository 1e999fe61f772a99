from __future__ import annotations

import json
import random
from argparse import Namespace

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.assets.arithmetic import read_rows
from asyncrl.assets.pretrain import learning_rate, main, noisy_answer

TINY_RUN = ["--device", "cpu", "--steps", "3", "--batch-size", "8", "--warmup-steps", "1", "--log-every", "3"]
TINY_RUN += ["--n-train", "20", "--n-eval", "10", "--eval-samples", "2"]


@pytest.fixture(scope="module")
def runs(run_twice):
    """The same tiny pretraining run twice, to compare what each wrote."""
    return run_twice(main, "tiny-arith", TINY_RUN)


def test_pretrain_writes_a_loadable_asset_and_splits(runs):
    out = runs[0]
    model = AutoModelForCausalLM.from_pretrained(out / "tiny-arith")
    tokenizer = AutoTokenizer.from_pretrained(out / "tiny-arith")
    assert model.config.vocab_size == len(tokenizer)
    assert len(read_rows(out / "arith" / "train.jsonl")) == 20
    assert len(read_rows(out / "arith" / "eval.jsonl")) == 10
    record = json.loads((out / "tiny-arith" / "pretrain.json").read_text())
    assert record["args"]["steps"] == 3
    assert set(record["eval"]) == {"greedy", "temperature_1"}


def test_pretrain_is_deterministic_on_cpu(runs):
    first, second = ((out / "tiny-arith" / "model.safetensors").read_bytes() for out in runs)
    assert first == second


def test_noisy_answer_changes_only_the_last_digit_at_the_asked_rate():
    rng = random.Random(0)
    answers = [noisy_answer(85, rng, p_correct=0.35) for _ in range(4000)]
    assert {a // 10 for a in answers} == {8}
    assert set(answers) == set(range(80, 90))
    assert answers.count(85) / len(answers) == pytest.approx(0.35, abs=0.03)


def test_learning_rate_warms_up_then_decays_to_a_tenth():
    args = Namespace(lr=1.0, warmup_steps=10, steps=110)
    assert learning_rate(0, args) == pytest.approx(0.1)
    assert learning_rate(10, args) == pytest.approx(1.0)
    assert learning_rate(110, args) == pytest.approx(0.1)
