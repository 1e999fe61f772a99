"""Properties every registered loss must have, run over LOSSES.names()."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.losses import LOSSES, LossBatch, LossOutput
from asyncrl.losses.base import OPTIONAL_FIELDS
from asyncrl.losses.policy import IS_MODES
from asyncrl.registry import RegistryError

from .conftest import run_loss

SPEC_METRICS = {
    "sampling/importance_sampling_ratio/mean",
    "sampling/importance_sampling_ratio/min",
    "sampling/importance_sampling_ratio/max",
    "sampling/masked_mean",
    "sampling/sampling_logp_difference/mean",
    "sampling/sampling_logp_difference/max",
    "clip_ratio/region_mean",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_max",
}


def random_batch(dtype: torch.dtype = torch.float64, seed: int = 0, T: int = 24, K: int = 5) -> LossBatch:
    """Realistic values on trained slots; padding slots hold NaN advantages and entropies and -inf sampler
    logprobs; the first sequence is truncated."""
    generator = torch.Generator().manual_seed(seed)
    sampler_top = torch.log_softmax(torch.randn(T, K + 3, generator=generator, dtype=torch.float64), -1)[:, :K]
    sampler_top[1, -2:] = -math.inf  # the sampler returned fewer than K
    top = sampler_top.clamp(min=-20) + 0.3 * torch.randn(T, K, generator=generator, dtype=torch.float64)
    sampler = sampler_top[:, 0].clone()
    logprobs = sampler + 0.4 * torch.randn(T, generator=generator, dtype=torch.float64)
    logprobs[2] += 5.0  # an extreme ratio
    mask = (torch.rand(T, generator=generator) > 0.3).double()
    advantages = torch.randn(T, generator=generator, dtype=torch.float64)
    padding = mask == 0
    advantages[padding] = math.nan
    sampler[padding] = -math.inf
    entropy = torch.rand(T, generator=generator, dtype=torch.float64) * 3
    entropy[padding] = math.nan
    reference = logprobs + 0.3 * torch.randn(T, generator=generator, dtype=torch.float64)
    reference[padding] = math.nan
    return LossBatch(
        logprobs=logprobs.to(dtype).requires_grad_(),
        sampler_logprobs=sampler.to(dtype),
        advantages=advantages.to(dtype),
        mask=mask.to(dtype),
        sequence_index=torch.arange(T) // 4,
        top_logprobs=top.to(dtype).requires_grad_(),
        sampler_top_logprobs=sampler_top.to(dtype),
        entropy=entropy.to(dtype),
        truncated=torch.arange(T) < 4,
        ref_logprobs=reference.to(dtype),
    )


def run(name: str, batch: LossBatch, **options) -> LossOutput:
    out = run_loss(name, batch, **options)
    (out.loss_sum - (0 if out.entropy_mean is None else out.entropy_mean)).backward()
    return out


def grad(tensor: torch.Tensor) -> torch.Tensor:
    """The gradient, zero when the loss does not read the tensor."""
    return torch.zeros_like(tensor) if tensor.grad is None else tensor.grad


# Every shared option switched on at once, under each importance-sampling mode.
ALL_OPTIONS = [
    {"importance_sampling": mode, "off_policy_mask_threshold": 0.05, "mask_truncated_completions": True,
     "top_entropy_quantile": 0.6, "normalization": "sequence", "entropy_coef": 0.1}
    for mode in IS_MODES
]  # fmt: skip
# The KL penalty (bias-corrected) on each loss's sequence-level ratio.
KL_OPTIONS = {"beta": 0.1, "importance_sampling_level": "sequence", "mask_truncated_completions": True,
              "normalization": "sequence"}  # fmt: skip


@pytest.fixture(params=LOSSES.names())
def loss_name(request) -> str:
    return request.param


@pytest.fixture(
    params=[{}, *ALL_OPTIONS, KL_OPTIONS], ids=lambda o: o.get("importance_sampling", "kl" if o else "defaults")
)
def options(request, loss_name) -> dict:
    sequence = (
        request.param.get("importance_sampling", "").startswith("sequence")
        or "importance_sampling_level" in request.param
    )
    if loss_name == "score_centering" and sequence:
        pytest.skip("score centering rejects sequence-level corrections (tested in test_score_centering)")
    return request.param


def test_registry_has_the_issue_losses():
    assert {"clipped", "score_centering", "cispo", "sapo", "gspo", "luspo", "vespo"} <= set(LOSSES.names())


def test_masked_tokens_get_zero_gradient(loss_name, options):
    batch = random_batch()
    out = run(loss_name, batch, **options)
    padding = batch.mask == 0
    assert padding.any() and torch.isfinite(out.loss_sum)
    for tensor in (grad(batch.logprobs), grad(batch.top_logprobs)):
        assert torch.isfinite(tensor).all()
        assert torch.equal(tensor[padding], torch.zeros_like(tensor[padding]))
    assert grad(batch.logprobs)[~padding].abs().sum() > 0


def test_doubling_the_batch_doubles_loss_sum(loss_name):
    batch = random_batch()
    doubled = LossBatch(
        logprobs=torch.cat([batch.logprobs, batch.logprobs]),
        sampler_logprobs=torch.cat([batch.sampler_logprobs, batch.sampler_logprobs]),
        advantages=torch.cat([batch.advantages, batch.advantages]),
        mask=torch.cat([batch.mask, batch.mask]),
        sequence_index=torch.cat([batch.sequence_index, batch.sequence_index + 100]),
        top_logprobs=torch.cat([batch.top_logprobs, batch.top_logprobs]),
        sampler_top_logprobs=torch.cat([batch.sampler_top_logprobs, batch.sampler_top_logprobs]),
    )
    loss = LOSSES.build({"name": loss_name})
    single, double = loss(batch), loss(doubled)
    torch.testing.assert_close(double.loss_sum, 2 * single.loss_sum)
    for key in ("sampling/importance_sampling_ratio/mean", "clip_ratio/region_mean", "clip_ratio/high_max"):
        assert double.metrics[key] == pytest.approx(single.metrics[key])


def test_float32_matches_float64(loss_name, options):
    out64, batch64 = run(loss_name, b := random_batch(torch.float64), **options), b
    out32, batch32 = run(loss_name, b := random_batch(torch.float32), **options), b
    assert out32.loss_sum.dtype == torch.float32
    torch.testing.assert_close(out32.loss_sum.double(), out64.loss_sum, rtol=1e-5, atol=1e-5)
    for name in ("logprobs", "top_logprobs"):
        grad32, grad64 = grad(getattr(batch32, name)), grad(getattr(batch64, name))
        torch.testing.assert_close(grad32.double(), grad64, rtol=1e-5, atol=1e-5)
    for key, value in out64.metrics.items():
        assert out32.metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def test_returns_spec_metrics_as_floats(loss_name):
    out = LOSSES.build({"name": loss_name})(random_batch())
    assert SPEC_METRICS <= set(out.metrics)
    assert all(type(value) is float and math.isfinite(value) for value in out.metrics.values())
    assert out.loss_sum.dim() == 0


def test_declares_only_optional_batch_fields(loss_name):
    assert LOSSES.get(loss_name).requires <= OPTIONAL_FIELDS


def test_accepts_the_shared_options(loss_name):
    shared = {"importance_sampling": "token_truncate", "is_clip_min": 0.2, "is_clip_max": 8, "normalization": "token"}
    built = LOSSES.build({"name": loss_name, **shared})
    assert isinstance(built(random_batch()), LossOutput)
    assert built.options.is_clip_max == 8


def test_rejects_an_unknown_option(loss_name):
    with pytest.raises(RegistryError, match=rf"loss '{loss_name}' has no parameter 'importance_samplin' \(has: "):
        LOSSES.build({"name": loss_name, "importance_samplin": "token_mask"})
