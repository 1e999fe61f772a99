"""benchmarks/soak.py's memory verdict: window means tell a leak from the allocator's swing."""

from __future__ import annotations

from types import ModuleType


def test_window_means_pass_a_swing_and_climb_with_a_leak(soak: ModuleType) -> None:
    """Samples every 2 s for 10 minutes: a sawtooth of +-5% around 500 MB spreads 10.5% among single samples but its
    2-minute means stay within 1%; 1.2 MB/min of growth under the same swing makes the means climb window by window."""
    times = [2.0 * i for i in range(300)]
    swing = [(t, 500 * (1.05 if (t // 20) % 2 else 0.95)) for t in times]
    leak = [(t, mb + 1.2 * t / 60) for t, mb in swing]
    means = soak.window_means(swing, 120.0, 120.0)
    assert len(means) == 4 and soak.spread(means) < 0.01 < 0.10 < soak.spread([mb for t, mb in swing if t >= 120])
    leaking = soak.window_means(leak, 120.0, 120.0)
    assert leaking == sorted(leaking) and soak.spread(leaking) > 0.01


def test_a_last_window_counts_only_when_at_least_half_full(soak: ModuleType) -> None:
    samples = [(float(t), 100.0 + (50.0 if t >= 240 else 0.0)) for t in range(0, 250, 2)]
    assert soak.window_means(samples, 0.0, 120.0) == [100.0, 100.0]  # 240-248 s: a twelfth of a window
    assert soak.window_means(samples + [(float(t), 150.0) for t in range(250, 302, 2)], 0.0, 120.0)[-1] == 150.0
