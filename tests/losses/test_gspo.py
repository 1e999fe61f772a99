"""GSPO and LUSPO by hand and against a float64 reference (one clipped geometric-mean ratio per sequence)."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.losses import LossBatch

from .conftest import assert_float64_close, batch_of, random_sequences, run_loss, sequence_clip_reference


def test_one_ratio_per_sequence(make_batch):
    batch = make_batch(logprobs=[-1.0, -1.2, -0.5, -2.0], sampler_logprobs=[-1.1, -1.1, -1.5, -2.0],
                       advantages=[1.0, 1.0, -1.0, 7.0], mask=[1, 1, 1, 0], sequence_index=[0, 0, 1, 2])  # fmt: skip
    # sequence 0: mean log-ratio (0.1 - 0.1) / 2 = 0 -> s = 1, A = 1 -> loss -1; gradient per slot -A s / 2
    # sequence 1: s = e^1 > 1 + 0.28, A < 0 -> min(-e, -1.28) = -e -> loss +e; gradient -A s = e
    out = run_loss("gspo", batch, epsilon=0.2, epsilon_high=0.28)
    assert_float64_close(out.loss_sum, -1.0 + math.e)
    out.loss_sum.backward()
    assert_float64_close(batch.logprobs.grad, [-0.5, -0.5, math.e, 0.0])
    # LUSPO multiplies each sequence's loss by its length (2 and 1)
    assert_float64_close(run_loss("luspo", batch, epsilon=0.2, epsilon_high=0.28).loss_sum, -2.0 + math.e)


@pytest.mark.parametrize("by_length", [False, True], ids=["gspo", "luspo"])
@pytest.mark.parametrize(("epsilon", "epsilon_high"), [(3e-4, 4e-4), (0.2, 0.28)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_float64_reference_with_masks_and_extreme_ratios(seed, epsilon, epsilon_high, by_length):
    inputs = random_sequences(seed)
    batch = batch_of(inputs)
    out = run_loss("luspo" if by_length else "gspo", batch, epsilon=epsilon, epsilon_high=epsilon_high)
    out.loss_sum.backward()
    value, grad = sequence_clip_reference(inputs, epsilon, epsilon_high, by_length)
    assert_float64_close(out.loss_sum, value)
    assert_float64_close(batch.logprobs.grad, grad)


@pytest.mark.parametrize("name", ["gspo", "luspo"])
def test_gradcheck(name):
    sampler = -torch.rand(7, dtype=torch.float64) - 0.2
    # sequences of 3, 2 and 2 slots; their mean log-ratios (0.1, -0.3, 0.6) keep s away from 1 -+ 0.2/0.28
    offsets = torch.tensor([0.2, -0.1, 0.2, -0.5, -0.1, 0.9, 0.3], dtype=torch.float64)

    def loss(lp):
        return run_loss(name, LossBatch(
            logprobs=lp, sampler_logprobs=sampler, advantages=torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, 2.0, 2.0],
            dtype=torch.float64), mask=torch.ones(7, dtype=torch.float64),
            sequence_index=torch.tensor([0, 0, 0, 1, 1, 2, 2]),
        ), epsilon=0.2, epsilon_high=0.28).loss_sum  # fmt: skip

    assert torch.autograd.gradcheck(loss, ((sampler + offsets).requires_grad_(),))
