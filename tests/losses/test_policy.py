"""The shared loss options (importance-sampling modes, off-policy and truncation masks, top-entropy slots,
per-sequence normalisation, the entropy term), checked on the clipped loss against a float64 reference."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from asyncrl.losses import LOSSES, LossBatch
from asyncrl.losses.policy import IS_MODES, ImportanceSampling, Normalization, PolicyOptions

from .conftest import assert_float64_close, batch_of, random_sequences, run_loss, sequence_clip_reference

EPS, EPS_HIGH = 0.2, 0.28


def reference(inputs, truncated, *, mode, c_min=0.5, c_max=5.0, delta=None, mask_truncated=False, quantile=1.0,
              normalization="token"):  # fmt: skip
    """Clipped-loss value and d/d logprob, slot by slot from the formulas in docs/losses.md."""
    lp, mu, adv, mask, seq, ent = (
        inputs[k] for k in ("logprobs", "sampler_logprobs", "advantages", "mask", "sequence_index", "entropy")
    )
    trained = mask > 0
    policy = trained & ~(np.asarray(truncated) if mask_truncated else np.zeros(len(lp), bool))
    top = np.ones(len(lp), bool)
    if quantile < 1:
        top = np.where(policy, ent, -np.inf) >= np.quantile(ent[policy], 1 - quantile)
    value, grad = 0.0, np.zeros(len(lp))
    for i in np.unique(seq):
        slots = np.flatnonzero((seq == i) & trained)
        if slots.size == 0:
            continue
        log_ratio_sum = sum(lp[t] - mu[t] for t in slots)
        gap = sum(mu[t] - lp[t] for t in slots) / slots.size
        if delta is not None and adv[slots[0]] < 0 and gap > delta:
            continue
        seq_weight = math.exp(log_ratio_sum)
        if mode == "sequence_mask" and not c_min <= seq_weight <= c_max:
            continue
        if mode == "sequence_truncate":
            seq_weight = min(max(seq_weight, c_min), c_max)
        for t in slots:
            if not (policy[t] and top[t]):
                continue
            r, weight = math.exp(lp[t] - mu[t]), 1.0
            if mode == "token_mask" and not c_min <= r <= c_max:
                continue
            if mode == "token_truncate":
                r = min(max(r, c_min), c_max)  # the truncated ratio's gradient w.r.t. logprob is itself
            if mode.startswith("sequence"):
                r, weight = 1.0, seq_weight  # the sequence weight carries the correction; the ratio is 1
            if normalization == "sequence":
                weight /= slots.size
            unclipped, clipped = r * adv[t], min(max(r, 1 - EPS), 1 + EPS_HIGH) * adv[t]
            value -= weight * min(unclipped, clipped)
            grad[t] = -weight * r * adv[t] if unclipped <= clipped else 0.0
    return value, grad


def check(seed, *, truncated=None, **options):
    inputs = random_sequences(seed)
    truncated = truncated if truncated is not None else [i == 0 for i in inputs["sequence_index"]]
    batch = batch_of(inputs, truncated)
    names = {"mode": "importance_sampling", "delta": "off_policy_mask_threshold", "c_min": "is_clip_min",
             "c_max": "is_clip_max", "mask_truncated": "mask_truncated_completions",
             "quantile": "top_entropy_quantile"}  # fmt: skip
    out = run_loss(
        "clipped", batch, epsilon=EPS, epsilon_high=EPS_HIGH, **{names.get(k, k): v for k, v in options.items()}
    )
    out.loss_sum.backward()
    value, grad = reference(inputs, truncated, **options)
    assert_float64_close(out.loss_sum, value)
    assert_float64_close(batch.logprobs.grad, grad)
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("mode", IS_MODES)
def test_importance_sampling_modes_match_reference(mode, seed):
    # wide sequence bounds so that some sequences of the random data fall inside them
    bounds = {"c_min": 0.05, "c_max": 20.0} if mode.startswith("sequence") else {}
    check(seed, mode=mode, **bounds)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_off_policy_mask_matches_reference(seed):
    out = check(seed, mode="none", delta=0.05)
    assert math.isfinite(out.loss_sum.item())


@pytest.mark.parametrize("seed", [0, 3])
def test_truncated_completions_and_top_entropy_and_sequence_normalisation(seed):
    check(seed, mode="token_mask", mask_truncated=True, quantile=0.4, normalization="sequence")


def test_sequence_mask_hand_example(make_batch):
    batch = make_batch(
        logprobs=[-1.0, -1.0, -0.5, -3.0],
        sampler_logprobs=[-1.5, -1.2, -0.5, -1.0],
        advantages=[2.0, 2.0, -1.0, 5.0],
        mask=[1, 1, 1, 1],
        sequence_index=[0, 0, 1, 2],
    )
    # sequence 0: log w = 0.5 + 0.2 -> w = e^0.7 = 2.0138 inside [0.5, 5]; each slot -w * A = -4.0275
    # sequence 1: w = 1 -> +1; sequence 2: w = e^-2 = 0.135 < 0.5 dropped
    out = run_loss("clipped", batch, importance_sampling="sequence_mask")
    w = math.exp(0.7)
    assert_float64_close(out.loss_sum, -2 * 2 * w + 1.0)
    out.loss_sum.backward()
    assert_float64_close(batch.logprobs.grad, [-2 * w, -2 * w, 1.0, 0.0])
    assert out.metrics["sampling/masked_mean"] == pytest.approx(0.25)


def test_top_entropy_extremes_and_truncation_need_their_fields(make_batch):
    args = dict(logprobs=[-1.0, -1.0, -1.0], sampler_logprobs=[-1.0, -1.0, -1.0], advantages=[1.0, 2.0, 4.0],
                mask=[1, 1, 1], sequence_index=[0, 1, 2])  # fmt: skip
    # quantile 0 keeps only the highest-entropy slot (A = 2); 1 keeps all
    only_max = run_loss("clipped", make_batch(**args, entropy=[0.1, 0.9, 0.5]), top_entropy_quantile=0.0)
    assert_float64_close(only_max.loss_sum, -2.0)
    assert_float64_close(run_loss("clipped", make_batch(**args, entropy=[0.1, 0.9, 0.5])).loss_sum, -7.0)
    with pytest.raises(ValueError, match="LossBatch.entropy"):
        run_loss("clipped", make_batch(**args), top_entropy_quantile=0.5)
    with pytest.raises(ValueError, match="LossBatch.truncated"):
        run_loss("clipped", make_batch(**args), mask_truncated_completions=True)


def test_gradcheck_with_masks_and_sequence_normalisation():
    """Where the loss is a function of the logprobs (masks fixed), autograd matches finite differences.

    The truncate and sequence modes are not: their weights are detached by design (truncated IS), so their
    gradient is checked against the reference above instead.
    """
    generator = torch.Generator().manual_seed(1)
    sampler = -torch.rand(8, dtype=torch.float64, generator=generator) - 0.5
    # slot 2 leaves [0.5, 5] (masked) and sequence 2 is off-policy with A < 0; the others avoid the clip's kinks
    offsets = torch.tensor([0.05, -0.1, 2.5, -0.05, -0.6, -0.7, 0.3, 0.02], dtype=torch.float64)
    base = dict(sampler_logprobs=sampler, advantages=torch.tensor([1.0, 1.0, -1.0, -1.0, -2.0, -2.0, 0.5, 0.5],
                dtype=torch.float64), mask=torch.ones(8, dtype=torch.float64), sequence_index=torch.arange(8) // 2,
                entropy=torch.tensor([0.1, 0.2, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4], dtype=torch.float64))  # fmt: skip

    def loss(lp):
        return run_loss("clipped", LossBatch(logprobs=lp, **base), epsilon_high=0.28, off_policy_mask_threshold=0.5,
                            top_entropy_quantile=0.8, normalization="sequence").loss_sum  # fmt: skip

    assert torch.autograd.gradcheck(loss, ((sampler + offsets).requires_grad_(),))


# ---- the entropy term ---------------------------------------------------------------------------------------


def test_entropy_term_value_and_exact_gradient(make_batch):
    batch = make_batch(
        logprobs=[-1.0, -2.0, -0.5, -1.5], sampler_logprobs=[-1.0, -2.0, -0.5, -1.5], advantages=[1.0, 1.0, -1.0, 0.0],
        mask=[1, 1, 1, 0], sequence_index=[0, 0, 1, 2], entropy=[0.5, 1.5, 2.5, math.nan], truncated=[0, 0, 1, 0],
    )  # fmt: skip
    batch.entropy.requires_grad_()
    out = run_loss("clipped", batch, entropy_coef=0.1, mask_truncated_completions=True)
    # the set is the trained, non-truncated slots 0 and 1: mean (0.5 + 1.5) / 2
    assert_float64_close(out.entropy_mean, 1.0)
    out.entropy_mean.backward()
    assert_float64_close(batch.entropy.grad, [0.5, 0.5, 0.0, 0.0])
    assert run_loss("clipped", batch).entropy_mean is None


def test_entropy_score_function_gradient_is_the_entropy_gradient_in_expectation():
    """Summed over every token o with sampler weight mu(o), the estimate equals grad H exactly."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(6, dtype=torch.float64, generator=generator, requires_grad=True)
    sampler = torch.log_softmax(torch.randn(6, dtype=torch.float64, generator=generator), -1)
    logp = torch.log_softmax(logits, -1)
    entropy = -(logp.exp() * logp).sum()
    (exact,) = torch.autograd.grad(entropy, logits)
    expected = torch.zeros_like(logits)
    for o in range(6):
        lp = torch.log_softmax(logits, -1)[o : o + 1]
        one = torch.ones(1, dtype=torch.float64)
        batch = LossBatch(logprobs=lp, sampler_logprobs=sampler[o : o + 1], advantages=0 * one, mask=one,
                          sequence_index=torch.zeros(1, dtype=torch.long),
                          entropy=entropy.detach().reshape(1))  # fmt: skip
        out = run_loss("clipped", batch, importance_sampling="none", entropy_coef=1.0)
        assert_float64_close(out.entropy_mean, entropy.detach())
        (estimate,) = torch.autograd.grad(out.entropy_mean, logits)
        expected += sampler[o].exp() * estimate
    assert_float64_close(expected, exact)


# ---- options ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"importance_sampling": "token_clip"}, "importance_sampling"),
        ({"is_clip_min": 3.0, "is_clip_max": 2.0}, "is_clip_min"),
        ({"off_policy_mask_threshold": -0.1}, "off_policy_mask_threshold"),
        ({"top_entropy_quantile": 1.5}, "top_entropy_quantile"),
        ({"normalization": "batch"}, "normalization"),
        ({"entropy_coef": -0.1}, "entropy_coef"),
        ({"entropy_target": 1.0, "entropy_coef": 2.0}, "entropy_coef_max"),
    ],
)
def test_bad_options_fail_naming_the_key(options, named):
    with pytest.raises(ValueError, match=named):
        PolicyOptions(**options)


def test_options_are_typed_with_per_loss_defaults():
    built = LOSSES.build({"name": "clipped", "normalization": "constant"})
    assert built.options.normalization is Normalization.constant
    assert LOSSES.build({"name": "gspo"}).options.normalization is Normalization.sequence
    assert LOSSES.build({"name": "cispo"}).options.importance_sampling is ImportanceSampling.none
    assert LOSSES.build({"name": "clipped"}).options.importance_sampling is ImportanceSampling.token_mask


def kl_reference(inputs, ref, truncated, *, beta, bias_correction, mode, normalization, mask_truncated, level):
    """beta x the k3 KL term (TRL's per_token_kl, times coef_1 under bias correction): value, d/d logprob and the
    `kl` metric, slot by slot; ``mode`` none or token_mask (bounds [0.5, 5])."""
    lp, mu, mask, seq = (inputs[k] for k in ("logprobs", "sampler_logprobs", "mask", "sequence_index"))
    value, grad, kls = 0.0, np.zeros(len(lp)), []
    for i in np.unique(seq):
        slots = [t for t in np.flatnonzero((seq == i) & (mask > 0)) if not (mask_truncated and truncated[t])]
        if not slots:
            continue
        weight = beta / len(slots) if normalization == "sequence" else beta
        s = math.exp(sum(lp[t] - mu[t] for t in slots) / len(slots))  # GSPO's ratio; every slot kept (mode none)
        spread = 0.0  # at level=sequence: d(the sequence's terms) / d(log s), which reaches each slot / |o|
        for t in slots:
            d = ref[t] - lp[t]
            kl, dkl = math.exp(d) - d - 1, 1 - math.exp(d)
            r = s if level == "sequence" else math.exp(lp[t] - mu[t])
            corrected = bias_correction and (mode == "none" or 0.5 <= r <= 5.0)  # token_mask drops r outside
            factor = r if corrected else 1.0
            kls.append(factor * kl)
            value += weight * factor * kl
            grad[t] += weight * factor * dkl  # d(factor)/d(log r) = factor where corrected:
            if corrected and level == "token":
                grad[t] += weight * factor * kl
            if corrected and level == "sequence":
                spread += weight * factor * kl
        for t in slots:
            grad[t] += spread / len(slots)
    return value, grad, float(np.mean(kls))


KL_CASES = [
    {"mode": "token_mask", "normalization": "token", "mask_truncated": False, "level": "token"},
    {"mode": "none", "normalization": "sequence", "mask_truncated": True, "level": "token"},
    {"mode": "none", "normalization": "token", "mask_truncated": False, "level": "sequence"},
]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("bias_correction", [False, True])
@pytest.mark.parametrize("case", KL_CASES, ids=lambda c: f"{c['mode']}-{c['normalization']}-{c['level']}")
def test_kl_penalty_matches_reference(seed, bias_correction, case):
    """The KL part of the loss (the loss at beta minus the loss at 0) against TRL's per-token formula in float64,
    extreme sampler ratios included: on every trained slot of a completion that trains (truncated ones dropped),
    the IS mask leaving it alone, times the loss's ratio under bias correction (a sequence's at level=sequence)."""
    inputs = random_sequences(seed)
    ref = inputs["logprobs"] + np.random.default_rng(seed + 10).normal(scale=0.5, size=len(inputs["logprobs"]))
    truncated = [i == 0 for i in inputs["sequence_index"]]
    options = {"importance_sampling": case["mode"], "normalization": case["normalization"],
               "mask_truncated_completions": case["mask_truncated"],
               "importance_sampling_level": case["level"], "use_bias_correction_kl": bias_correction}  # fmt: skip
    with_kl, without = batch_of(inputs, truncated, ref), batch_of(inputs, truncated, ref)
    out = run_loss("clipped", with_kl, beta=0.04, epsilon=EPS, epsilon_high=EPS_HIGH, **options)
    base = run_loss("clipped", without, epsilon=EPS, epsilon_high=EPS_HIGH, **options)
    out.loss_sum.backward()
    base.loss_sum.backward()
    value, grad, mean_kl = kl_reference(inputs, ref, truncated, beta=0.04, bias_correction=bias_correction, **case)
    assert_float64_close(out.loss_sum - base.loss_sum, value)
    assert_float64_close(with_kl.logprobs.grad - without.logprobs.grad, grad)
    assert out.metrics["kl"] == pytest.approx(mean_kl, rel=1e-12)
    assert "kl" not in base.metrics  # logged only with a KL term, as TRL's


def test_the_kl_penalty_needs_the_reference_logprobs(make_batch):
    batch = make_batch(logprobs=[-1.0], sampler_logprobs=[-1.0], advantages=[1.0], mask=[1])
    with pytest.raises(ValueError, match="LossBatch.ref_logprobs"):
        run_loss("clipped", batch, beta=0.1)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sequence_level_ratio_matches_reference_and_is_gspo(seed):
    inputs = random_sequences(seed)
    batch, gspo = batch_of(inputs), batch_of(inputs)
    options = {"importance_sampling": "none", "epsilon": EPS, "epsilon_high": EPS_HIGH}
    out = run_loss("clipped", batch, importance_sampling_level="sequence", **options)
    out.loss_sum.backward()
    value, grad = sequence_clip_reference(inputs, EPS, EPS_HIGH, by_length=True)  # token-normalised = LUSPO's
    assert_float64_close(out.loss_sum, value)
    assert_float64_close(batch.logprobs.grad, grad)
    # TRL's GSPO is its grpo loss at importance_sampling_level=sequence: so is asyncrl's, per sequence
    per_sequence = run_loss("clipped", batch_of(inputs), importance_sampling_level="sequence",
                            normalization="sequence", **options)  # fmt: skip
    assert_float64_close(per_sequence.loss_sum, run_loss("gspo", gspo, **options).loss_sum)


def test_sequence_level_reaches_every_loss_that_takes_a_ratio(make_batch):
    """cispo's capped weight and sapo's gate see the sequence's ratio s = e^((0.2 + 0.6) / 2) = e^0.4 on each
    slot; vespo's product of ratios and gspo's mean are the same at either level."""
    args = dict(logprobs=[-1.0, -1.0, -2.0], sampler_logprobs=[-1.2, -1.6, -2.0], advantages=[1.0, 1.0, -1.0],
                mask=[1, 1, 1], sequence_index=[0, 0, 1])  # fmt: skip
    s = math.exp(0.4)
    cispo = run_loss("cispo", make_batch(**args), importance_sampling_level="sequence", epsilon_high=1.3)
    assert_float64_close(cispo.loss_sum, -1.3 * (-1.0 - 1.0) + 1.0 * -2.0)  # min(s, 1.3) = 1.3; sequence 1: s = 1
    sapo = run_loss("sapo", make_batch(**args), importance_sampling_level="sequence", normalization="token")
    gate = torch.sigmoid(torch.tensor((s - 1.0) * 1.0, dtype=torch.float64)) * 4
    assert_float64_close(sapo.loss_sum, -2 * gate + torch.sigmoid(torch.tensor(0.0, dtype=torch.float64)) * 4 / 1.05)
    for name in ("vespo", "gspo", "luspo"):
        levels = [run_loss(name, make_batch(**args), importance_sampling_level=level).loss_sum
                  for level in ("token", "sequence")]  # fmt: skip
        assert_float64_close(levels[1], levels[0].detach())
