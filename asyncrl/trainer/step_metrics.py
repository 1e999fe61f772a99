"""Per-step batch, sample and performance metrics (names and units from the spec's metric tables)."""

from __future__ import annotations

from asyncrl.packing.row import PackedRow
from asyncrl.trainer.assembler import Step
from asyncrl.trainer.flops import MfuMeter


def batch_metrics(step: Step, rows: list[PackedRow], token_budget: int) -> dict[str, float]:
    samples = step.samples
    forwarded = sum(r.num_forwarded for r in rows)
    raw = sum(r.num_raw_tokens for r in rows)
    trained = sum(r.num_trained for r in rows)
    # forwarded positions whose logits train some token (a tree row's shared position can train several samples')
    training_positions = sum(int(r.token_index.unique().numel()) for r in rows)
    out = {
        "batch/forwarded_tokens_per_step": float(forwarded),
        "batch/trained_tokens_per_step": float(trained),
        "batch/samples_per_step": float(len(samples)),
        "batch/groups_per_step": float(len({s.group_id for s in samples})),
        "batch/microbatches_per_step": float(len(step.placement)),
        "batch/masked_token_frac": 1.0 - training_positions / max(forwarded, 1),
        "batch/samples_per_row": len(samples) / max(len(rows), 1),
        "batch/row_tokens_mean": forwarded / max(len(rows), 1),
        "batch/row_tokens_max": float(max((r.num_forwarded for r in rows), default=0)),
        "batch/row_fill_frac": forwarded / max(len(rows) * token_budget, 1),
        "batch/row_imbalance": row_imbalance(step, [r.attention_cost() for r in rows]),
        "batch/packing_ratio": raw / max(forwarded, 1),
        "batch/pad_frac": 0.0,
    }
    images = [len(r.images.image_grid_thw) for r in rows if r.images is not None]
    if images:  # a vision-language run's: the images the vision tower ran on (a tree row's shared ones once)
        out["batch/images_per_step"] = float(sum(images))
    return out


def row_imbalance(step: Step, costs: list[int]) -> float:
    """The step's time on each micro-batch's most loaded rank over its time if every rank carried the mean load
    (1.0 = balanced; an empty row is an idle rank): ``costs`` are the attention costs of ``step.rows``."""
    slowest = balanced = 0.0
    for micro in step.placement:
        loads = [costs[index] if index is not None else 0 for index in micro]
        slowest += max(loads)
        balanced += sum(loads) / len(loads)
    return slowest / balanced if balanced else 1.0


def sample_events(step: Step) -> dict[str, list[float]]:
    """Per-sample events (means over the window's trained samples)."""
    events: dict[str, list[float]] = {
        "sample/forwarded_tokens_mean": [], "sample/forwarded_tokens_max": [], "sample/trained_tokens_mean": [],
        "reward_group_std": [],
    }  # fmt: skip
    for s in step.samples:
        events["sample/forwarded_tokens_mean"].append(s.num_tokens)
        events["sample/forwarded_tokens_max"].append(s.num_tokens)
        events["sample/trained_tokens_mean"].append(s.num_trained)
        events["reward_group_std"].append(s.group_std)
        for name, value in s.reward_components.items():
            events.setdefault(name, []).append(value)
    return events


def perf_metrics(
    rows: list[PackedRow], fwd_s: float, fwd_bwd_s: float, optimizer_s: float, wait_s: float, mfu: MfuMeter | None,
    flops: float,
) -> dict[str, float]:  # fmt: skip
    """Seconds and throughput of the step's compute; MFU over fwd+bwd where the meter knows model and device."""
    forwarded = sum(r.num_forwarded for r in rows)
    out = {
        "perf/fwd_s": fwd_s,
        "perf/fwd_bwd_s": fwd_bwd_s,
        "perf/optimizer_s": optimizer_s,
        "perf/rollout_wait_s": wait_s,
        "perf/fwd_bwd_forwarded_tokens_per_s": forwarded / max(fwd_bwd_s, 1e-9),
    }
    if mfu is not None:
        out["perf/fwd_bwd_mfu"] = mfu.mfu(flops, fwd_bwd_s)
    return out
