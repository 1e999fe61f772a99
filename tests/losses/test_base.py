"""LossBatch validation, loss requirements and the shared mask/metric helpers."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.losses import LOSSES, LossBatch, PolicyLoss
from asyncrl.losses.base import importance_mask, masked_extreme, per_sequence_fraction
from asyncrl.registry import RegistryError


def test_loss_batch_names_the_field_with_a_wrong_shape():
    with pytest.raises(ValueError, match="LossBatch.advantages"):
        LossBatch(torch.zeros(3), torch.zeros(3), torch.zeros(2), torch.ones(3), torch.zeros(3, dtype=torch.long))


def test_loss_batch_needs_both_top_k_fields_with_matching_shapes():
    base = dict(
        logprobs=torch.zeros(3),
        sampler_logprobs=torch.zeros(3),
        advantages=torch.zeros(3),
        mask=torch.ones(3),
        sequence_index=torch.zeros(3, dtype=torch.long),
    )
    with pytest.raises(ValueError, match="given together"):
        LossBatch(**base, top_logprobs=torch.zeros(3, 2))
    with pytest.raises(ValueError, match=r"\[T=3, K\]"):
        LossBatch(**base, top_logprobs=torch.zeros(3, 2), sampler_top_logprobs=torch.zeros(3, 4))


def test_requirements_are_declared_on_the_loss_class_and_read_off_the_built_loss():
    assert LOSSES.get("score_centering").requires == {"top_logprobs", "sampler_top_logprobs"}
    built = LOSSES.build({"name": "score_centering", "epsilon": 0.3})
    assert built.requires == {"top_logprobs", "sampler_top_logprobs"} and built.options.epsilon == 0.3
    assert LOSSES.build({"name": "clipped"}).requires == frozenset()


def test_requires_rejects_unknown_fields():
    with pytest.raises(TypeError, match="top_logprob"):

        class Misdeclared(PolicyLoss):
            requires = frozenset({"top_logprob"})


def test_registry_rejects_a_misspelt_parameter():
    with pytest.raises(RegistryError, match="epsilon_hihg"):
        LOSSES.build({"name": "clipped", "epsilon_hihg": 0.3})


def test_importance_mask_is_inclusive_and_overflow_free():
    log_ratio = torch.tensor([math.log(0.5), math.log(5.0), -1.0, 2.0, 1e6, -math.inf, math.nan], dtype=torch.float64)
    assert importance_mask(log_ratio, 0.5, 5.0).tolist() == [True, True, False, False, False, False, False]
    assert importance_mask(log_ratio, 0.0, math.inf).tolist() == [True, True, True, True, True, True, False]
    with pytest.raises(ValueError, match="is_clip_min"):
        importance_mask(log_ratio, 2.0, 1.0)


def test_per_sequence_fraction_ignores_untrained_tokens_and_handles_sparse_ids():
    flags = torch.tensor([True, False, True, True, False])
    trained = torch.tensor([True, True, False, True, False])
    fractions = per_sequence_fraction(flags, trained, torch.tensor([7, 7, 7, 42, 1000]))
    assert fractions[:2].tolist() == [0.5, 1.0] and math.isnan(fractions[2])
    assert masked_extreme(fractions, ~fractions.isnan(), largest=False).item() == 0.5


def test_metrics_are_nan_without_trained_tokens():
    batch = LossBatch(torch.zeros(2), torch.zeros(2), torch.ones(2), torch.zeros(2), torch.zeros(2, dtype=torch.long))
    out = LOSSES.build({"name": "clipped"})(batch)
    assert out.loss_sum.item() == 0.0
    assert math.isnan(out.metrics["sampling/importance_sampling_ratio/mean"])
    assert math.isnan(out.metrics["clip_ratio/high_max"])


@pytest.mark.parametrize("name", ["clipped", "cispo", "gspo", "sapo", "vespo", "luspo"])
def test_a_micro_batch_without_trained_tokens_gives_no_metric(name):
    empty = torch.zeros(0, dtype=torch.float64)
    batch = LossBatch(empty.clone().requires_grad_(), empty, empty, empty, torch.zeros(0, dtype=torch.long))
    out = LOSSES.build({"name": name})(batch)
    assert out.loss_sum.item() == 0.0
    assert math.isnan(out.metrics["clip_ratio/low_min"]) and math.isnan(out.metrics["clip_ratio/high_max"])
    assert math.isnan(out.metrics["sampling/importance_sampling_ratio/max"])
