"""The clipped surrogate with masked IS, by hand and against a float64 reference."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from asyncrl.losses import LossBatch

from .conftest import run_loss


def test_clips_high_ratio_and_ignores_masked_token(make_batch):
    batch = make_batch(
        logprobs=[-0.5, -0.2, -0.1],
        sampler_logprobs=[-1.5, -0.2, -0.1],
        advantages=[1.0, -1.0, 99.0],
        mask=[1, 1, 0],
        sequence_index=[0, 0, 1],
    )
    # token 0: ratio e ~ 2.72 (inside [0.5, 5]) -> clipped to 1.2 -> -1.2; token 1: ratio 1 -> +1.0; token 2 masked
    out = run_loss("clipped", batch, epsilon=0.2)
    torch.testing.assert_close(out.loss_sum, torch.tensor(-0.2, dtype=torch.float64))
    out.loss_sum.backward()
    # token 0 sits on the flat clipped branch; token 1: d/dlogp of -(r * -1) = r = 1
    torch.testing.assert_close(batch.logprobs.grad, torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64))
    assert out.metrics["sampling/importance_sampling_ratio/mean"] == pytest.approx((math.e + 1) / 2)
    assert out.metrics["sampling/sampling_logp_difference/max"] == pytest.approx(1.0)
    assert out.metrics["clip_ratio/high_mean"] == pytest.approx(0.5)
    assert out.metrics["clip_ratio/high_max"] == pytest.approx(0.5)
    assert out.metrics["clip_ratio/low_mean"] == 0.0


def test_drops_tokens_outside_importance_bounds_and_uses_epsilon_high(make_batch):
    batch = make_batch(
        logprobs=[0.0, -3.0, -1.0, -1.0],
        sampler_logprobs=[-2.0, -1.0, -1.25, -0.5],
        advantages=[1.0, -1.0, 2.0, -1.0],
        mask=[1, 1, 1, 1],
        sequence_index=[0, 0, 1, 1],
    )
    # token 0: ratio e^2 = 7.39 > 5 dropped; token 1: ratio e^-2 = 0.135 < 0.5 dropped
    # token 2: ratio e^0.25 = 1.284, A = 2 -> clip at 1 + 0.28 -> -2.56
    # token 3: ratio e^-0.5 = 0.607, A = -1 -> min(-0.607, -0.8) = -0.8 (clipped low) -> +0.8
    out = run_loss("clipped", batch, epsilon=0.2, epsilon_high=0.28)
    torch.testing.assert_close(out.loss_sum, torch.tensor(-1.76, dtype=torch.float64))
    assert out.metrics["sampling/masked_mean"] == pytest.approx(0.5)
    assert out.metrics["sampling/importance_sampling_ratio/min"] == pytest.approx(math.exp(-2))
    assert out.metrics["clip_ratio/region_mean"] == pytest.approx(0.5)
    # sequence 1 has one of two tokens clipped low and one clipped high; sequence 0 none
    assert out.metrics["clip_ratio/low_min"] == pytest.approx(0.0)
    assert out.metrics["clip_ratio/high_max"] == pytest.approx(0.5)


def test_delta_caps_the_ratio_of_a_negative_advantage(make_batch):
    batch = make_batch(logprobs=[-0.5, -0.5], sampler_logprobs=[-2.0, -2.0], advantages=[-1.0, 1.0], mask=[1, 1])
    # ratio e^1.5 = 4.48 on both; A < 0: -min(min(r, 3) A, clip(r) A) = -(3 * -1) = 3, flat above delta (no gradient);
    # A > 0: the clip at 1.2 already binds below delta -> -1.2
    out = run_loss("clipped", batch, delta=3.0)
    torch.testing.assert_close(out.loss_sum, torch.tensor(3.0 - 1.2, dtype=torch.float64))
    out.loss_sum.backward()
    torch.testing.assert_close(batch.logprobs.grad, torch.zeros(2, dtype=torch.float64))
    uncapped = run_loss("clipped", make_batch(logprobs=[-0.5], sampler_logprobs=[-2.0], advantages=[-1.0], mask=[1]))
    torch.testing.assert_close(uncapped.loss_sum, torch.tensor(math.exp(1.5), dtype=torch.float64))


def reference(logprobs, sampler_logprobs, advantages, mask, eps_low, eps_high, c_min, c_max, delta=None):
    """Loss and d loss / d logprob in float64, token by token from the spec's formula (TRL's delta cap)."""
    value, grad = 0.0, np.zeros(len(logprobs))
    for t, (lp, slp, a, m) in enumerate(zip(logprobs, sampler_logprobs, advantages, mask, strict=True)):
        r = math.exp(lp - slp)
        if not m or not c_min <= r <= c_max:
            continue
        capped = r if delta is None else min(r, delta)
        unclipped, clipped = capped * a, min(max(r, 1 - eps_low), 1 + eps_high) * a
        value -= min(unclipped, clipped)
        grad[t] = -r * a if unclipped <= clipped and capped == r else 0.0
    return value, grad


@pytest.mark.parametrize("delta", [None, 1.5])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_float64_reference_with_masks_and_extreme_ratios(make_batch, seed, delta):
    rng = np.random.default_rng(seed)
    T = 40
    sampler = -rng.random(T) * 4
    logprobs = sampler + rng.normal(scale=0.4, size=T)
    logprobs[:5] = sampler[:5] + rng.choice([-8.0, 8.0], size=5)  # ratios e^+-8
    advantages = rng.normal(size=T)
    mask = (rng.random(T) > 0.2).astype(float)
    advantages[mask == 0] = -1e6
    batch = make_batch(logprobs.tolist(), sampler.tolist(), advantages.tolist(), mask.tolist())

    out = run_loss("clipped", batch, epsilon=0.2, epsilon_high=0.28, is_clip_min=0.5, is_clip_max=5.0, delta=delta)
    out.loss_sum.backward()
    value, grad = reference(logprobs, sampler, advantages, mask, 0.2, 0.28, 0.5, 5.0, delta)
    torch.testing.assert_close(out.loss_sum, torch.tensor(value, dtype=torch.float64))
    torch.testing.assert_close(batch.logprobs.grad, torch.tensor(grad))


def test_gradcheck():
    generator = torch.Generator().manual_seed(0)
    T = 8
    sampler = -torch.rand(T, dtype=torch.float64, generator=generator) * 2
    # offsets keep every ratio away from the clip and IS boundaries, where the loss has kinks
    offsets = torch.tensor([0.05, -0.1, 0.5, -0.5, 0.1, 3.0, -0.05, 0.3], dtype=torch.float64)
    logprobs = (sampler + offsets).requires_grad_()

    def loss(lp):
        batch = LossBatch(
            logprobs=lp,
            sampler_logprobs=sampler,
            advantages=torch.tensor([1.0, -1.0, 1.0, -1.0, -2.0, 1.0, 0.5, -0.5], dtype=torch.float64),
            mask=torch.tensor([1, 1, 1, 1, 1, 1, 0, 1], dtype=torch.float64),
            sequence_index=torch.zeros(T, dtype=torch.long),
        )
        return run_loss("clipped", batch, epsilon=0.2, epsilon_high=0.28).loss_sum

    assert torch.autograd.gradcheck(loss, (logprobs,))
