"""SAPO by hand and against a float64 reference (soft sigmoid gate, per-sequence normalisation)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from asyncrl.losses import LossBatch

from .conftest import assert_float64_close, batch_of, random_sequences, run_loss


def sigmoid(x):
    return 1 / (1 + math.exp(-x))


def test_gate_is_the_plain_gradient_on_policy_and_fades_off_policy(make_batch):
    batch = make_batch(logprobs=[-1.0, -0.5, -1.0], sampler_logprobs=[-1.0, -1.0, -1.0], advantages=[1.0, -1.0, 0.0],
                       mask=[1, 1, 0], sequence_index=[0, 1, 2])  # fmt: skip
    # slot 0: r = 1, A > 0, tau 1: f = sigmoid(0) * 4 = 2 -> -2; gradient -A * 4 s (1 - s) r = -1
    # slot 1: r = e^0.5, A < 0, tau 1.05: f = sigmoid(1.05 (r - 1)) * 4 / 1.05 -> +f
    r, s = math.exp(0.5), sigmoid(1.05 * (math.exp(0.5) - 1))
    out = run_loss("sapo", batch)
    assert_float64_close(out.loss_sum, -2.0 + s * 4 / 1.05)
    out.loss_sum.backward()
    assert_float64_close(batch.logprobs.grad, [-1.0, 4 * s * (1 - s) * r, 0.0])
    assert out.metrics["clip_ratio/region_mean"] == 0.0


def reference(inputs, tau_pos, tau_neg):
    lp, mu, adv, mask, seq = (inputs[k] for k in ("logprobs", "sampler_logprobs", "advantages", "mask",
                                                  "sequence_index"))  # fmt: skip
    value, grad = 0.0, np.zeros(len(lp))
    for t in np.flatnonzero(mask > 0):
        length = ((seq == seq[t]) & (mask > 0)).sum()
        r = math.exp(lp[t] - mu[t])
        tau = tau_pos if adv[t] > 0 else tau_neg
        s = sigmoid(tau * (r - 1))
        value -= s * 4 / tau * adv[t] / length
        grad[t] = -4 * s * (1 - s) * r * adv[t] / length
    return value, grad


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_float64_reference_with_masks_and_extreme_ratios(seed):
    inputs = random_sequences(seed)
    batch = batch_of(inputs)
    out = run_loss("sapo", batch, tau_pos=0.9, tau_neg=1.05)
    out.loss_sum.backward()
    value, grad = reference(inputs, 0.9, 1.05)
    assert_float64_close(out.loss_sum, value)
    assert_float64_close(batch.logprobs.grad, grad)


def test_rejects_non_positive_temperatures(make_batch):
    batch = make_batch([-1.0], [-1.0], [1.0], [1])
    with pytest.raises(ValueError, match="tau_neg"):
        run_loss("sapo", batch, tau_neg=0.0)


def test_gradcheck():
    sampler = -torch.rand(6, dtype=torch.float64) - 0.2
    offsets = torch.tensor([0.1, -0.4, 1.5, -2.0, 0.0, 0.3], dtype=torch.float64)

    def loss(lp):
        return run_loss("sapo", LossBatch(
            logprobs=lp, sampler_logprobs=sampler, advantages=torch.tensor([1.0, 1.0, -1.0, -1.0, 2.0, -0.5],
            dtype=torch.float64), mask=torch.ones(6, dtype=torch.float64), sequence_index=torch.arange(6) // 2,
        )).loss_sum  # fmt: skip

    assert torch.autograd.gradcheck(loss, ((sampler + offsets).requires_grad_(),))
