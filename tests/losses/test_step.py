"""StepLoss: normalisation over the step, truncated completions, the entropy bonus and its adaptive
coefficient, step-level advantages, the config checks that run the loss before training starts, and every
loss inside the real trainer step.

The trainer-step tests run ``Trainer._optimize`` on a tiny random model with synthetic packed rows: forward,
loss, backward and the optimizer step. The trainer is assembled without ``__init__`` (which starts a server
and a rollout worker); the attributes set here are the ones ``_optimize`` reads.
"""

from __future__ import annotations

import copy
import math
import queue
import uuid
from types import SimpleNamespace

import pytest
import torch
from sharded import sharded

from asyncrl.advantages import ADVANTAGES
from asyncrl.assets.tiny_model import build_model, build_tokenizer
from asyncrl.config import ConfigError
from asyncrl.config.compose import compose
from asyncrl.losses import LOSSES
from asyncrl.losses.step import StepLoss, StepTotals
from asyncrl.metrics import MetricWindow
from asyncrl.packing.flat import FlatRow
from asyncrl.plan.assemble import plan_run
from asyncrl.prompts import render_prompt
from asyncrl.rollout.loop import AsyncRolloutLoop
from asyncrl.rollout.types import Rollout, RolloutSample, TrainingSequence, TurnRecord
from asyncrl.trainer.assembler import Step
from asyncrl.trainer.loop import Trainer
from asyncrl.trainer.model import build_grad_scaler
from asyncrl.trainer.ranks import Ranks
from asyncrl.trainer.reference import build_reference
from asyncrl.trainer.timeline import Timeline


def sample(advantage: float, trained: int, *, reward: float | None = None, truncated: bool = False,
           rollout_id: str | None = None) -> RolloutSample:  # fmt: skip
    """Two prompt tokens then ``trained`` completion tokens, each with sampler logprob -1."""
    sequence = TrainingSequence(token_ids=list(range(3, 5 + trained)), mask=[0, 0] + [1] * trained,
                                sampler_logprobs=[0.0, 0.0] + [-1.0] * trained, truncated=truncated)  # fmt: skip
    return RolloutSample(sequence=sequence, advantage=advantage, reward=advantage if reward is None else reward,
                         group_id=0, row_index=0, prompt_index=0, model_version=0,
                         rollout_id=rollout_id or uuid.uuid4().hex)  # fmt: skip


def rows_of(*rows: list[RolloutSample], top_k: int = 0):
    packed = []
    for samples in rows:
        row = FlatRow(token_budget=10_000)
        for s in samples:
            row.add(s)
        packed.append(row.pack(top_k))
    return packed


def on_policy(row, entropy: float | list[float] = 1.0) -> SimpleNamespace:
    """A forward whose logprobs equal the sampler's (every ratio 1), so the clipped loss is -A per slot."""
    values = torch.as_tensor(entropy, dtype=torch.float32).expand(row.num_trained).clone()
    return SimpleNamespace(logprobs=row.sampler_logprobs.clone().requires_grad_(), top_logprobs=None, entropy=values)


def step_totals(step_loss: StepLoss, rows, entropy=1.0) -> tuple[float, StepTotals]:
    """The step's loss summed over its rows as backpropagated, and the totals it ends with."""
    norm, totals, total = step_loss.norm(rows), StepTotals(), 0.0
    for row in rows:
        loss, _, part = step_loss.loss(step_loss.batch(row, on_policy(row, entropy), norm), norm)
        total, totals = total + float(loss.detach()), totals + part
    return total, totals


def step_total(step_loss: StepLoss, rows, entropy=1.0) -> float:
    return step_totals(step_loss, rows, entropy)[0]


ROWS = ([1.0, 2], [-2.0, 3]), ([0.5, 4],)  # (advantage, trained tokens) per sample, per row


@pytest.mark.parametrize(
    ("normalization", "expected"),
    [
        # token: sum_t -A_t over all 9 tokens / 9 = -(2 - 6 + 2) / 9
        ("token", 2 / 9),
        # sequence: mean over the 3 sequences of each one's token mean -A = -(1 - 2 + 0.5) / 3
        ("sequence", 0.5 / 3),
        # constant: sum_t -A_t / (max_completion_length 10 x 3 sequences)
        ("constant", 2 / 30),
        # micro_batch: row 0 -(2 - 6) / 5 = 0.8, row 1 -2 / 4 = -0.5, averaged over the 2 micro-batches
        ("micro_batch", 0.15),
    ],
)
def test_normalizations(normalization, expected):
    rows = rows_of(*[[sample(a, n) for a, n in row] for row in ROWS])
    step_loss = StepLoss(LOSSES.build({"name": "clipped", "normalization": normalization}), None, 10)
    assert step_total(step_loss, rows) == pytest.approx(expected, rel=1e-6)


def test_truncated_completions_leave_the_loss_and_its_denominator():
    rows = rows_of([sample(1.0, 2), sample(-2.0, 3, truncated=True)], [sample(0.5, 4)])
    step_loss = StepLoss(LOSSES.build({"name": "clipped", "mask_truncated_completions": True}))
    # kept tokens: 2 + 4 = 6; -(1 * 2 + 0.5 * 4) / 6
    assert step_total(step_loss, rows) == pytest.approx(-4 / 6, rel=1e-6)
    counts = step_loss.norm(rows).counts
    assert counts.tokens == 6 and counts.sequences == 2
    assert step_total(StepLoss(LOSSES.build("clipped")), rows) == pytest.approx(2 / 9, rel=1e-6)


def test_static_entropy_bonus_is_the_step_token_mean_whatever_the_normalisation():
    rows = rows_of([sample(1.0, 2), sample(-2.0, 3)], [sample(0.5, 4)])
    step_loss = StepLoss(LOSSES.build({"name": "clipped", "normalization": "sequence", "entropy_coef": 0.1}))
    norm, totals, total = step_loss.norm(rows), StepTotals(), 0.0
    for row, entropy in zip(rows, (2.0, 0.5), strict=True):
        loss, _, part = step_loss.loss(step_loss.batch(row, on_policy(row, entropy), norm), norm)
        total, totals = total + float(loss.detach()), totals + part
    # policy 0.5 / 3 (sequence normalisation); entropy mean over the 9 tokens (5 * 2 + 4 * 0.5) / 9
    assert total == pytest.approx(0.5 / 3 - 0.1 * 12 / 9, rel=1e-6)
    assert step_loss.end_step(totals) == pytest.approx({"loss": total, "policy_loss": 0.5 / 3, "entropy_coef": 0.1})
    assert step_loss.state_dict() == {}


def test_adaptive_coefficient_is_gated_moves_toward_the_target_and_survives_a_checkpoint():
    spec = {"name": "clipped", "entropy_coef": 0.1, "entropy_target": 1.0, "entropy_coef_delta": 0.05,
            "entropy_coef_max": 0.12}  # fmt: skip
    rows = rows_of([sample(1.0, 2)])
    step_loss = StepLoss(LOSSES.build(spec))
    # entropy 0.5 <= target: the bonus applies (-1 policy - 0.1 x 0.5), then the coefficient rises, capped at 0.12
    total, totals = step_totals(step_loss, rows, entropy=0.5)
    assert total == pytest.approx(-1.0 - 0.05, rel=1e-6)
    assert step_loss.end_step(totals)["entropy_coef"] == pytest.approx(0.1)
    assert step_loss.entropy_coef == pytest.approx(0.12)
    # entropy 2.0 > target: no bonus this step, and the coefficient falls by delta
    total, totals = step_totals(step_loss, rows, entropy=2.0)
    assert total == pytest.approx(-1.0, rel=1e-6)
    step_loss.end_step(totals)
    assert step_loss.entropy_coef == pytest.approx(0.07)

    resumed = StepLoss(LOSSES.build(spec))
    resumed.load_state_dict(step_loss.state_dict())
    assert resumed.entropy_coef == pytest.approx(0.07)
    assert StepLoss(LOSSES.build("clipped")).state_dict() == {}


def test_every_rank_trains_with_the_norm_rank_0_decided():
    """The step's norm carries rank 0's adaptive entropy coefficient: a follower's StepLoss, which never ends a
    step, trains with it rather than with its own."""
    spec = {"name": "clipped", "entropy_coef": 0.1, "entropy_target": 1.0, "entropy_coef_delta": 0.05,
            "entropy_coef_max": 0.12}  # fmt: skip
    rows = rows_of([sample(1.0, 2)])
    leader, follower = StepLoss(LOSSES.build(spec)), StepLoss(LOSSES.build(spec))
    leader.end_step(step_totals(leader, rows, entropy=0.5)[1])  # rank 0's coefficient rises to 0.12
    norm = leader.norm(rows)
    loss, _, totals = follower.loss(follower.batch(rows[0], on_policy(rows[0], 0.5), norm), norm)
    assert float(loss) == pytest.approx(-1.0 - 0.12 * 0.5, rel=1e-6) and totals.entropy == pytest.approx(0.5)
    assert follower.entropy_coef == pytest.approx(0.1)  # untouched: the coefficient's state is rank 0's


def test_default_loss_keeps_the_global_token_mean():
    rows = rows_of([sample(1.0, 2), sample(-2.0, 3)], [sample(0.5, 4)], top_k=1)
    step_loss = StepLoss(LOSSES.build({"name": "score_centering"}))
    norm = step_loss.norm(rows)
    row = rows[0]
    forward = on_policy(row)
    forward.top_logprobs = torch.full((row.num_trained, 1), -5.0)
    batch = step_loss.batch(row, forward, norm)
    loss, metrics, totals = step_loss.loss(batch, norm)
    torch.testing.assert_close(loss, LOSSES.build("score_centering")(batch).loss_sum / 9)
    assert step_loss.end_step(totals) == {"loss": pytest.approx(float(loss))} and "sampling/sampler_mass" in metrics


def test_step_level_advantages():
    # rollout "a" has two sequences (counted once); "c" is unscorable (NaN reward, advantage 0)
    samples = [
        sample(1.0, 2, reward=3.0, rollout_id="a"),
        sample(1.0, 1, reward=3.0, rollout_id="a"),
        sample(-1.0, 2, reward=1.0, rollout_id="b"),
        sample(0.0, 2, reward=math.nan, rollout_id="c"),
    ]
    rows = rows_of(samples)
    lite = StepLoss(LOSSES.build("clipped"), ADVANTAGES.build("group_mean_batch_std"))
    # std of the rewards 3 and 1 is 1: advantages unchanged in value
    torch.testing.assert_close(lite.batch(rows[0], on_policy(rows[0]), lite.norm(rows)).advantages,
                               torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, 0.0, 0.0]))  # fmt: skip

    gdpo = StepLoss(LOSSES.build("clipped"), ADVANTAGES.build({"name": "gdpo"}))
    shifted = rows_of([sample(a + 2.0, n, reward=s.reward, rollout_id=s.rollout_id) for a, n, s in
                       zip((1.0, 1.0, -1.0, 0.0), (2, 1, 2, 2), samples, strict=True)])  # fmt: skip
    # scorable advantages 3 and 1: mean 2, std 1 -> +1, -1; the unscorable rollout stays 0
    torch.testing.assert_close(gdpo.batch(shifted[0], on_policy(shifted[0]), gdpo.norm(shifted)).advantages,
                               torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, 0.0, 0.0]))  # fmt: skip


def test_rollouts_that_hit_the_length_budget_are_flagged_for_the_loss():
    def rollout(finish_reason):
        turn = TurnRecord(prompt_ids=[3, 4], output_ids=[5, 6], output_log_probs=[-1.0, -1.0],
                          finish_reason=finish_reason)  # fmt: skip
        return Rollout(completion=[], completion_ids=[5, 6], turns=[turn])

    loop = AsyncRolloutLoop.__new__(AsyncRolloutLoop)
    group = loop.build_group([], {"prompt": []}, [rollout("stop"), rollout("length"), rollout("abort")],
                             group_id=0, row_index=0, model_version=0)  # fmt: skip
    assert [seqs[0].truncated for seqs in group.completions_sequences] == [False, True, True]
    samples = [RolloutSample(sequence=seqs[0], advantage=1.0, reward=1.0, group_id=0, row_index=0, prompt_index=0,
                             model_version=0, rollout_id=str(i))
               for i, seqs in enumerate(group.completions_sequences)]  # fmt: skip
    (row,) = rows_of(samples)
    step_loss = StepLoss(LOSSES.build("clipped"))
    batch = step_loss.batch(row, on_policy(row), step_loss.norm([row]))
    assert batch.truncated.tolist() == [False, False, True, True, True, True]


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["loss.importance_sampling=bogus"], "importance_sampling"),
        (["loss.is_clip_min=6.0"], "is_clip_min"),
        (["loss=score_centering", "loss.importance_sampling=sequence_mask"], "importance_sampling"),
        (["loss=vespo", "loss.lambda_pos=0"], "lambda"),
        (["loss=gspo", "loss.epsilon=1.5"], "epsilon"),
        (["loss=clipped", "loss.entropy_target=1.0", "loss.entropy_coef=2.0"], "entropy_coef"),
        (["loss=cispo", "loss.top_entropy_quantile=2"], "top_entropy_quantile"),
        (["loss=clipped", "loss.delta=1.1"], r"delta=1.1 must be > 1 \+ epsilon_high = 1.2"),
        (["loss=score_centering", "+loss.delta=4"], "delta=4 is loss=clipped"),
        (["loss=score_centering", "loss.importance_sampling_level=sequence"], "importance_sampling_level=sequence"),
        (["loss.importance_sampling_level=sentence"], "importance_sampling_level='sentence' must be one of"),
        (["loss.beta=-0.1"], "beta=-0.1 must be >= 0"),
        (["loss.sync_ref_model=true"], "sync_ref_model=true needs beta > 0"),
        (["loss.beta=0.1", "loss.ref_model_mixup_alpha=1.5"], "ref_model_mixup_alpha=1.5 must be in"),
        (["loss.beta=0.1", "loss.ref_model_sync_steps=0"], "ref_model_sync_steps=0 must be >= 1"),
    ],
)
def test_config_validation_runs_the_loss(overrides, named):
    with pytest.raises(ConfigError, match=named):
        plan_run(compose(overrides))


# ---- inside the real trainer step ----------------------------------------------------------------------------

TOP_K = 4


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def trainer_for(overrides: list[str], model: torch.nn.Module, ranks: Ranks) -> Trainer:
    """The Trainer's step as the CLI runs it in one process: rank 0 of a world of one, its model sharded."""
    overrides = ["trainer.weight_decay=0.0", "trainer.learning_rate=1e-3", *overrides]
    plan = plan_run(compose(overrides))
    config, components = plan.config, plan.components
    trainer = Trainer.__new__(Trainer)
    trainer.config, trainer.ranks, trainer.world = config, ranks, 1
    trainer.model, trainer.optimizer, trainer.scheduler = sharded(config, model)
    trainer.loss = StepLoss(components.loss, components.advantage, config.sampling.max_completion_length)
    trainer.reference = build_reference(config, trainer.model, components.loss.options)
    trainer.scaler = build_grad_scaler(config)
    trainer.top_k = config.sampling.num_sampler_logprobs if "sampler_top_logprobs" in trainer.loss.requires else 0
    trainer.window, trainer.timeline = MetricWindow(), Timeline()
    trainer.token_budget = 256
    trainer.channels = SimpleNamespace(rollout_queue=queue.Queue())
    trainer.num_tokens = 0
    trainer.mfu, trainer.step_flops = None, 0.0  # a CPU: no peak, no MFU
    return trainer


def synthetic_sample(model, tokenizer, text: str, advantage: float, noise: float, generator, truncated=False):
    """A prompt plus completion whose sampler logprobs are the model's own, off by ``noise`` (a stale sampler)."""
    prompt = render_prompt(tokenizer, [{"role": "user", "content": "1+1="}], {})
    ids = prompt + tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    offsets = noise * torch.randn(len(ids), generator=generator)
    sampler, top = [0.0] * len(ids), [None] * len(ids)
    for i in range(len(prompt), len(ids)):
        sampler[i] = float(logp[i - 1, ids[i]] + offsets[i])
        values, indices = logp[i - 1].topk(TOP_K)
        top[i] = {int(v): float(lp) for v, lp in zip(indices, values, strict=True)}
    mask = [0] * len(prompt) + [1] * (len(ids) - len(prompt))
    sequence = TrainingSequence(ids, mask, sampler, sampler_top_logprobs=top, truncated=truncated)
    return RolloutSample(sequence=sequence, advantage=advantage, reward=advantage, group_id=0, row_index=0,
                         prompt_index=0, model_version=0, rollout_id=uuid.uuid4().hex)  # fmt: skip


@pytest.fixture(scope="module")
def model_and_samples(tokenizer):
    """The model and four samples: two from the current policy, two from a stale sampler; the second truncated."""
    model = build_model(tokenizer, seed=0)
    generator = torch.Generator().manual_seed(0)
    specs = (("\\boxed{2}", 1.5, 0.0), ("\\boxed{3} no", -0.5, 0.1), ("2", -1.0, 0.0), ("\\boxed{22}", 0.7, 0.1))
    samples = [synthetic_sample(model, tokenizer, text, advantage, noise, generator, truncated=i == 1)
               for i, (text, advantage, noise) in enumerate(specs)]  # fmt: skip
    return model, samples


def run_step(overrides: list[str], model_and_samples, ranks: Ranks, per_row: int = 2
             ) -> tuple[Trainer, dict[str, float], float]:  # fmt: skip
    """One trainer step of the four samples, ``per_row`` of them in each packed row."""
    model, samples = model_and_samples
    rows = []
    for start in range(0, len(samples), per_row):
        row = FlatRow(token_budget=256)
        for s in samples[start : start + per_row]:
            row.add(s)
        rows.append(row)
    trainer = trainer_for(overrides, copy.deepcopy(model), ranks)
    before = [p.detach().to_local().clone() for p in trainer.model.parameters()]
    trainer._optimize(Step(rows=rows, wait_s=0.0))
    after = [p.detach().to_local() for p in trainer.model.parameters()]
    moved = max(float((p - b).abs().max()) for p, b in zip(after, before, strict=True))
    return trainer, trainer.window.reduce(), moved


@pytest.mark.parametrize("loss", LOSSES.names())
def test_every_loss_trains_the_tiny_model(loss, model_and_samples, one_rank):
    _, metrics, moved = run_step([f"loss={loss}"], model_and_samples, one_rank)
    assert math.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0
    assert moved > 0
    assert math.isfinite(metrics["clip_ratio/region_mean"])


def test_every_option_at_once_through_the_trainer(model_and_samples, one_rank):
    overrides = ["loss=cispo", "advantage=group_mean_batch_std", "loss.importance_sampling=sequence_truncate",
                 "loss.off_policy_mask_threshold=0.5", "loss.mask_truncated_completions=true",
                 "loss.top_entropy_quantile=0.5", "loss.normalization=micro_batch", "loss.entropy_coef=0.01",
                 "loss.entropy_target=100.0"]  # fmt: skip
    trainer, metrics, moved = run_step(overrides, model_and_samples, one_rank)
    assert math.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0 and moved > 0
    assert math.isfinite(metrics["policy_loss"]) and metrics["entropy_coef"] == pytest.approx(0.01)
    # the tiny model's entropy is below the target of 100 nats: the adaptive coefficient went up for the next step
    assert trainer.loss.state_dict() == {"entropy_coef": pytest.approx(0.015)}


def test_the_kl_to_the_reference_is_logged_on_every_pass_of_a_step(model_and_samples, one_rank):
    """loss.beta > 0 loads the reference (model.name_or_path: the shipped tiny model, not the random one trained
    here) and logs `kl`, over trainer.num_iterations passes whose schedule counts one step; at beta 0, no `kl`."""
    overrides = ["loss=clipped", "loss.beta=0.1", "trainer.num_iterations=2"]
    trainer, metrics, moved = run_step(overrides, model_and_samples, one_rank)
    assert trainer.reference is not None and trainer.reference.steps == 1 and trainer.scheduler.last_epoch == 1
    assert metrics["kl"] > 0 and moved > 0
    assert "kl" not in run_step(["loss=clipped"], model_and_samples, one_rank)[1]


@pytest.mark.parametrize("normalization", ["token", "sequence"])
def test_a_step_spread_over_more_rows_makes_the_same_update(normalization, model_and_samples, one_rank):
    """trainer.samples_per_step packs a step's samples into as many rows as they take: the loss is normalised over
    the whole step, so one row or four give the same loss and gradient norm (taken before clipping; Adam's first
    update would hide a wrong scale). Two ranks: tests/trainer/test_distributed.py."""
    overrides = ["loss=clipped", f"loss.normalization={normalization}"]
    one_row, four_rows = (run_step(overrides, model_and_samples, one_rank, per_row=n)[1] for n in (4, 1))
    assert four_rows["loss"] == pytest.approx(one_row["loss"], rel=1e-5)
    assert four_rows["grad_norm"] == pytest.approx(one_row["grad_norm"], rel=1e-4)
