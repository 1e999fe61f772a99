"""VESPO by hand and against a float64 reference (gamma-shaped weight of the full sequence ratio)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from asyncrl.losses import LossBatch

from .conftest import assert_float64_close, batch_of, kept_sequences, random_sequences, run_loss


def phi(w, k, lam):
    return w**k * math.exp(lam * (1 - w))


def test_weight_is_one_on_policy_and_shrinks_off_policy(make_batch):
    batch = make_batch(logprobs=[-1.0, -2.0, -1.0], sampler_logprobs=[-1.0, -2.0 - math.log(2), -1.0],
                       advantages=[1.0, 2.0, -5.0], mask=[1, 1, 0], sequence_index=[0, 1, 2])  # fmt: skip
    # sequence 0: w = 1 -> phi = 1 -> -(1 * 1 * -1) = 1; sequence 1: w = 2, A > 0 -> phi = 4 e^-3 -> -(phi * 2 * -2)
    weight = phi(2.0, 2.0, 3.0)
    out = run_loss("vespo", batch)
    assert_float64_close(out.loss_sum, 1.0 + 4 * weight)
    out.loss_sum.backward()
    assert_float64_close(batch.logprobs.grad, [-1.0, -2 * weight, 0.0])
    assert out.metrics["vespo/phi_seq_mean"] == pytest.approx((1 + weight) / 2)


def reference(inputs, k_pos, lambda_pos, k_neg, lambda_neg):
    lp, mu = inputs["logprobs"], inputs["sampler_logprobs"]
    value, grad = 0.0, np.zeros(len(lp))
    for slots, a in kept_sequences(inputs):
        k, lam = (k_pos, lambda_pos) if a >= 0 else (k_neg, lambda_neg)
        weight = phi(math.exp(sum(lp[t] - mu[t] for t in slots)), k, lam)
        value -= sum(weight * a * lp[t] for t in slots)
        grad[slots] = -weight * a
    return value, grad


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_matches_float64_reference_with_masks_and_extreme_ratios(seed):
    inputs = random_sequences(seed, extreme=seed % 2 == 0)
    batch = batch_of(inputs)
    out = run_loss("vespo", batch, k_pos=2.1, lambda_pos=3.3, k_neg=2.9, lambda_neg=1.7)
    out.loss_sum.backward()
    value, grad = reference(inputs, 2.1, 3.3, 2.9, 1.7)
    assert_float64_close(out.loss_sum, value)
    assert_float64_close(batch.logprobs.grad, grad)


def test_rejects_a_non_positive_lambda(make_batch):
    with pytest.raises(ValueError, match="lambda"):
        run_loss("vespo", make_batch([-1.0], [-1.0], [1.0], [1]), lambda_neg=0.0)


def test_gradcheck_with_the_weight_held_fixed():
    """phi is detached by design; moving the sampler with the policy keeps it fixed under finite differences."""
    log_ratio = torch.tensor([0.1, -0.3, 0.5, -1.0, 0.2], dtype=torch.float64)

    def loss(lp):
        return run_loss("vespo", LossBatch(
            logprobs=lp, sampler_logprobs=lp.detach() - log_ratio, advantages=torch.tensor([1.0, 1.0, -2.0, -2.0, 0.5],
            dtype=torch.float64), mask=torch.ones(5, dtype=torch.float64), sequence_index=torch.tensor([0, 0, 1, 1, 2]),
        )).loss_sum  # fmt: skip

    assert torch.autograd.gradcheck(loss, (-torch.rand(5, dtype=torch.float64).requires_grad_(),))
