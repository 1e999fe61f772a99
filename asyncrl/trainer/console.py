"""What the user sees while training: one line per logging step with the numbers that matter."""

from __future__ import annotations

import math
from pathlib import Path

from rich.console import Console as RichConsole

from asyncrl.config.schema import Config

# (metric, label, format) in display order
_COLUMNS = (
    ("reward", "reward", "{:.3f}"),
    ("reward_kept", "kept", "{:.3f}"),
    ("frac_reward_zero_std", "zero_std", "{:.2f}"),
    ("completions/mean_length", "len", "{:.1f}"),
    ("entropy", "entropy", "{:.3f}"),
    ("rollout/generated_tokens_per_s", "gen tok/s", "{:.0f}"),
    ("perf/wall_clock_trained_tokens_per_s", "train tok/s", "{:.0f}"),
    ("sample/staleness_mean", "stale", "{:.2f}"),
    ("rollout/queue_size", "queue", "{:.0f}"),
    ("perf/step_s", "step_s", "{:.2f}"),
)


class Console:
    def __init__(self, config: Config) -> None:
        self.console = RichConsole(stderr=False, highlight=False)
        self.max_steps = config.trainer.max_steps

    def log_step(self, step: int, metrics: dict[str, float]) -> None:
        total = f"/{self.max_steps}" if self.max_steps > 0 else ""
        parts = [f"[bold]step {step}{total}[/bold]"]
        for key, label, fmt in _COLUMNS:
            value = metrics.get(key)
            if value is not None and not math.isnan(value):
                parts.append(f"{label} {fmt.format(value)}")
        self.console.print("  ".join(parts))

    def finish(self, step: int, model_dir: Path) -> None:
        self.console.print(f"[green]done[/green] after {step} steps; model saved to {model_dir}")

    def close(self) -> None:
        return None
