"""CISPO by hand and against a float64 reference (capped, detached importance weight times log-prob)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from asyncrl.losses import LossBatch

from .conftest import assert_float64_close, batch_of, random_sequences, run_loss


def test_caps_the_weight_and_ignores_masked_token(make_batch):
    batch = make_batch(logprobs=[-0.5, -1.0, -2.0], sampler_logprobs=[-1.5, -1.0, -2.0], advantages=[1.0, -2.0, 99.0],
                       mask=[1, 1, 0], sequence_index=[0, 1, 2])  # fmt: skip
    # slot 0: r = e > 2 -> weight 2 -> -(2 * 1 * -0.5) = 1; slot 1: r = 1 -> -(1 * -2 * -1) = -2; slot 2 masked
    out = run_loss("cispo", batch, epsilon_high=2.0)
    assert_float64_close(out.loss_sum, -1.0)
    out.loss_sum.backward()
    # the weight is detached: d/d logprob = -weight * A
    assert_float64_close(batch.logprobs.grad, [-2.0, 2.0, 0.0])
    assert out.metrics["cispo_clip_ratio"] == pytest.approx(0.5)
    assert out.metrics["clip_ratio/high_mean"] == pytest.approx(0.5)
    assert out.metrics["clip_ratio/low_mean"] == 0.0


def reference(inputs, epsilon_high):
    value, grad = 0.0, np.zeros(len(inputs["logprobs"]))
    columns = (inputs[k] for k in ("logprobs", "sampler_logprobs", "advantages", "mask"))
    for t, (lp, mu, a, m) in enumerate(zip(*columns, strict=True)):
        if m:
            weight = min(math.exp(lp - mu), epsilon_high)
            value -= weight * a * lp
            grad[t] = -weight * a
    return value, grad


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_float64_reference_with_masks_and_extreme_ratios(seed):
    inputs = random_sequences(seed)
    batch = batch_of(inputs)
    out = run_loss("cispo", batch, epsilon_high=3.0)
    out.loss_sum.backward()
    value, grad = reference(inputs, 3.0)
    assert_float64_close(out.loss_sum, value)
    assert_float64_close(batch.logprobs.grad, grad)


def test_gradcheck_with_the_weight_held_fixed():
    """The weight is detached by design, so the sampler moves with the policy: the ratio, hence the weight,
    stays fixed under finite differences and autograd must match them."""
    log_ratio = torch.tensor([0.1, -0.3, 2.0, -1.0, 0.0], dtype=torch.float64)

    def loss(lp):
        return run_loss("cispo", LossBatch(
            logprobs=lp, sampler_logprobs=lp.detach() - log_ratio, advantages=torch.tensor([1.0, -1.0, 2.0, 0.5, -2.0],
            dtype=torch.float64), mask=torch.ones(5, dtype=torch.float64), sequence_index=torch.arange(5),
        ), epsilon_high=5.0).loss_sum  # fmt: skip

    assert torch.autograd.gradcheck(loss, (-torch.rand(5, dtype=torch.float64).requires_grad_(),))
