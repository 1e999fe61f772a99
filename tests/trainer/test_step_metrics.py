"""Per-step batch metrics of packed rows: what a shared tree position counts as."""

from __future__ import annotations

import time

import pytest

from asyncrl.packing import PACKERS
from asyncrl.rollout.types import RolloutSample, TrainingSequence
from asyncrl.trainer.assembler import Step
from asyncrl.trainer.step_metrics import batch_metrics


def sample(completion: list[int]) -> RolloutSample:
    tokens = [5, 6, 7, 8, *completion]  # one 4-token prompt
    seq = TrainingSequence(tokens, [0] * 4 + [1] * len(completion), [0.0] * len(tokens))
    return RolloutSample(seq, advantage=1.0, reward=1.0, group_id=0, row_index=0, prompt_index=0, model_version=0,
                         rollout_id="r", queued_at=time.time())  # fmt: skip


@pytest.mark.parametrize("packing", ["flat", "tree"])
def test_masked_token_frac_counts_forwarded_positions_that_train_nothing(packing):
    """Two identical completions share every tree position, so they train more tokens than the row forwards;
    the masked fraction is still the share of forwarded positions without a loss slot."""
    factory, _ = PACKERS.build({"name": packing}).rows(64)
    row = factory()
    for completion in ([9, 10, 1], [9, 10, 1]):
        row.add(sample(completion))
    packed = row.pack(0)
    metrics = batch_metrics(Step([row], wait_s=0.0), [packed], 64)
    forwarded, trained = metrics["batch/forwarded_tokens_per_step"], metrics["batch/trained_tokens_per_step"]
    # flat: two 7-token samples, each trains 3 positions; tree: 7 shared positions, 3 of which train (both samples)
    assert (forwarded, trained) == ((14.0, 6.0) if packing == "flat" else (7.0, 6.0))
    assert metrics["batch/masked_token_frac"] == pytest.approx(8 / 14 if packing == "flat" else 4 / 7)
