"""Score centering against the spec's gradient formula, by hand and in float64."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from asyncrl.losses import LossBatch

from .conftest import run_loss


def test_hand_example_three_tokens(make_batch):
    log = math.log
    batch = make_batch(
        logprobs=[log(0.5), log(0.1), -0.3],
        sampler_logprobs=[log(0.4), log(0.01), -0.3],
        advantages=[1.0, -2.0, 99.0],
        mask=[1, 1, 0],
        sequence_index=[0, 1, 1],
        top_logprobs=[[log(0.5), log(0.3), log(0.05)], [log(0.6), log(0.1), log(0.2)], [-0.3, -2.0, -3.0]],
        sampler_top_logprobs=[[log(0.4), log(0.3), -math.inf], [log(0.7), log(0.01), log(0.2)], [-0.3, -2.0, -3.0]],
    )
    # token 0: r = 0.5/0.4 = 1.25 kept; top ratios 1.25, 1.0 kept, third slot empty (mu = 0)
    #          -> -(1) * (1.25 - (0.5 + 0.3)) = -0.45
    # token 1: r = 10 > 5 dropped; top ratios 0.857 kept, 10 dropped, 1.0 kept -> -(-2) * (0 - (0.6 + 0.2)) = -1.6
    # token 2: masked (advantage 99 ignored). Total -2.05.
    out = run_loss("score_centering", batch)
    torch.testing.assert_close(out.loss_sum, torch.tensor(-2.05, dtype=torch.float64))
    out.loss_sum.backward()
    # d/d logprob = -A r where kept; d/d top logprob = +A pi(v) where kept (raw mu weights, not renormalised)
    torch.testing.assert_close(batch.logprobs.grad, torch.tensor([-1.25, 0.0, 0.0], dtype=torch.float64))
    expected_top = torch.tensor([[0.5, 0.3, 0.0], [-1.2, 0.0, -0.4], [0.0, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(batch.top_logprobs.grad, expected_top)
    assert out.metrics["sampling/masked_mean"] == pytest.approx(0.5)
    assert out.metrics["sampling/sampler_mass"] == pytest.approx((0.7 + 0.91) / 2)
    assert out.metrics["sampling/importance_sampling_ratio/max"] == pytest.approx(10.0)
    assert out.metrics["sampling/importance_sampling_ratio/mean"] == pytest.approx((1.25 + 10.0) / 2)
    # both trained ratios are above 1 + epsilon: "outside the trust region" counts them, one per sequence
    assert out.metrics["clip_ratio/high_mean"] == pytest.approx(1.0)
    assert out.metrics["clip_ratio/high_max"] == pytest.approx(1.0)
    assert out.metrics["clip_ratio/low_min"] == pytest.approx(0.0)


def reference_gradient(logits, sampler_logits, tokens, advantages, mask, top_k, c_min, c_max, truncate=False):
    """The spec's gradient w.r.t. the logits, with grad log softmax(theta)(v) = onehot(v) - softmax(theta).

    f(r) = r inside [c_min, c_max] and 0 outside (mask), or clip(r, c_min, c_max) with ``truncate``.
    """
    p = np.exp(logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True))
    mu = np.exp(sampler_logits - np.logaddexp.reduce(sampler_logits, axis=-1, keepdims=True))
    grad = np.zeros_like(logits)
    value = 0.0

    def f(r):
        if truncate:
            return min(max(r, c_min), c_max)
        return r if c_min <= r <= c_max else 0.0

    for t, o in enumerate(tokens):
        if not mask[t]:
            continue
        score = np.eye(logits.shape[-1]) - p[t]  # row v = grad log pi(v)
        top = np.argsort(mu[t])[-top_k:]
        centering = sum(mu[t, v] * f(p[t, v] / mu[t, v]) * score[v] for v in top)
        grad[t] = -advantages[t] * (f(p[t, o] / mu[t, o]) * score[o] - centering)
        value -= advantages[t] * (f(p[t, o] / mu[t, o]) - sum(mu[t, v] * f(p[t, v] / mu[t, v]) for v in top))
    return value, grad


@pytest.mark.parametrize("truncate", [False, True], ids=["token_mask", "token_truncate"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_float64_reference_with_masks_and_extreme_ratios(make_policy_batch, seed, truncate):
    rng = np.random.default_rng(seed)
    T, V, K = 12, 9, 4
    logits_np = rng.normal(size=(T, V))
    sampler_np = logits_np + rng.normal(scale=0.3, size=(T, V))
    sampler_np[:3] += rng.normal(scale=6.0, size=(3, V))  # ratios far outside [0.5, 5]
    tokens = rng.integers(0, V, size=T)
    advantages = rng.normal(size=T)
    mask = (rng.random(T) > 0.25).astype(float)
    advantages[mask == 0] = 1e6

    logits = torch.tensor(logits_np, requires_grad=True)
    batch = make_policy_batch(
        logits, torch.tensor(sampler_np), torch.tensor(tokens), torch.tensor(advantages), torch.tensor(mask), K
    )
    mode = "token_truncate" if truncate else "token_mask"
    out = run_loss("score_centering", batch, is_clip_min=0.5, is_clip_max=5.0, importance_sampling=mode)
    out.loss_sum.backward()

    value, grad = reference_gradient(logits_np, sampler_np, tokens, advantages, mask, K, 0.5, 5.0, truncate)
    torch.testing.assert_close(out.loss_sum, torch.tensor(value, dtype=torch.float64), rtol=0, atol=1e-10)
    torch.testing.assert_close(logits.grad, torch.tensor(grad), rtol=0, atol=1e-10)
    assert 0.0 < out.metrics["sampling/masked_mean"] < 1.0


def test_gradcheck():
    torch.manual_seed(0)
    T, K = 6, 3
    sampler_logprobs = -torch.rand(T, dtype=torch.float64) * 2
    sampler_top = -torch.rand(T, K, dtype=torch.float64) * 3
    sampler_top[0, 2] = -math.inf
    logprobs = (sampler_logprobs + 0.3 * torch.randn(T, dtype=torch.float64)).requires_grad_()
    top = (sampler_top.clamp(min=-5) + 0.3 * torch.randn(T, K, dtype=torch.float64)).requires_grad_()

    def loss(lp, tp):
        batch = LossBatch(
            logprobs=lp,
            sampler_logprobs=sampler_logprobs,
            advantages=torch.linspace(-1, 1, T, dtype=torch.float64),
            mask=torch.tensor([1, 1, 0, 1, 1, 1], dtype=torch.float64),
            sequence_index=torch.zeros(T, dtype=torch.long),
            top_logprobs=tp,
            sampler_top_logprobs=sampler_top,
        )
        return run_loss("score_centering", batch).loss_sum

    assert torch.autograd.gradcheck(loss, (logprobs, top))


def expected_gradient(loss_name, theta, sampler_logits, advantage, **options):
    """E_{o ~ mu}[grad of the token loss] at one position, over the full vocabulary (K = V)."""
    V = theta.numel()
    mu = torch.softmax(sampler_logits, -1)
    logp = torch.log_softmax(theta, -1).expand(V, V)  # slot o samples token o; all slots share theta
    sampler_logp = torch.log_softmax(sampler_logits, -1).expand(V, V)
    tokens = torch.arange(V)
    batch = LossBatch(
        logprobs=logp.gather(-1, tokens[:, None]).squeeze(-1),
        sampler_logprobs=sampler_logp.gather(-1, tokens[:, None]).squeeze(-1),
        advantages=advantage * mu,  # weighting slot o by mu(o) turns the sum into the expectation
        mask=torch.ones(V, dtype=theta.dtype),
        sequence_index=torch.zeros(V, dtype=torch.long),
        top_logprobs=logp,
        sampler_top_logprobs=sampler_logp,
    )
    (grad,) = torch.autograd.grad(run_loss(loss_name, batch, **options).loss_sum, theta)
    return grad


def test_expected_gradient_vanishes_when_sampler_equals_policy():
    theta = torch.randn(7, dtype=torch.float64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    grad = expected_gradient("score_centering", theta, theta.detach(), advantage=1.7)
    torch.testing.assert_close(grad, torch.zeros_like(grad), atol=1e-12, rtol=0)


@pytest.mark.parametrize("mode", ["token_mask", "token_truncate", "none"])
def test_expected_gradient_vanishes_even_with_mismatch_and_masked_ratios(mode):
    generator = torch.Generator().manual_seed(2)
    theta = torch.randn(7, dtype=torch.float64, generator=generator, requires_grad=True)
    sampler_logits = theta.detach() + 1.5 * torch.randn(7, dtype=torch.float64, generator=generator)
    ratios = torch.softmax(theta.detach(), -1) / torch.softmax(sampler_logits, -1)
    assert ((ratios < 0.5) | (ratios > 5.0)).any() and ((ratios >= 0.5) & (ratios <= 5.0)).any()

    centred = expected_gradient("score_centering", theta, sampler_logits, advantage=1.7, importance_sampling=mode)
    torch.testing.assert_close(centred, torch.zeros_like(centred), atol=1e-12, rtol=0)
    # the masked-IS clipped loss keeps a pull toward the sampler here: what centering removes
    assert expected_gradient("clipped", theta, sampler_logits, advantage=1.7).abs().max() > 1e-3


def test_requires_sampler_top_logprobs(make_batch):
    batch = make_batch(logprobs=[-0.5], sampler_logprobs=[-0.5], advantages=[1.0], mask=[1])
    with pytest.raises(ValueError, match="num_sampler_logprobs"):
        run_loss("score_centering", batch)


@pytest.mark.parametrize("mode", ["sequence_mask", "sequence_truncate"])
def test_rejects_sequence_level_corrections(make_batch, mode):
    batch = make_batch([-0.5], [-0.5], [1.0], [1], top_logprobs=[[-0.5]], sampler_top_logprobs=[[-0.5]])
    with pytest.raises(ValueError, match="token_mask, token_truncate or none"):
        run_loss("score_centering", batch, importance_sampling=mode)
