"""What a run prepares before anything starts: its datasets, with the evaluation switched off by its size."""

from __future__ import annotations

from asyncrl.config import compose, to_config
from asyncrl.trainer.setup import prepare


def test_the_default_prepares_its_eval_split_and_zero_eval_prompts_turn_it_off():
    assert prepare(to_config(compose([]))).eval_dataset is not None
    assert prepare(to_config(compose(["data.num_eval_prompts=0"]))).eval_dataset is None
