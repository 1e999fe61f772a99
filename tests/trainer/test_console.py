"""The console: bottleneck diagnosis from queue metrics, plain lines off a terminal, the completions table."""

from __future__ import annotations

import math

import pytest

from asyncrl.config.schema import Config
from asyncrl.flow import FlowControl
from asyncrl.trainer.console import (
    BALANCED,
    EVAL_LINE_EVERY_S,
    GENERATION_BOUND,
    TOO_TIGHT,
    TRAINER_BOUND,
    Console,
    classify_bottleneck,
    diagnose_bottleneck,
    servers_text,
)


def _queue(wait: float, backpressure: float, step_s: float = 2.0, **extra: float) -> dict[str, float]:
    return {"perf/rollout_wait_s": wait, "rollout/backpressure_s": backpressure, "perf/step_s": step_s, **extra}


@pytest.mark.parametrize(
    ("metrics", "label"),
    [
        (_queue(wait=1.2, backpressure=0.0, **{"rollout/queue_size": 0.0}), GENERATION_BOUND),
        (_queue(wait=0.0, backpressure=0.9, **{"rollout/queue_size": 32.0}), TRAINER_BOUND),
        (_queue(wait=0.8, backpressure=0.7), TOO_TIGHT),
        (_queue(wait=0.05, backpressure=0.1), BALANCED),  # both under 10% of a 2 s step
        (_queue(wait=0.15, backpressure=0.0, step_s=1.0), GENERATION_BOUND),  # 15% of a 1 s step
        (_queue(wait=0.15, backpressure=0.0, step_s=10.0), BALANCED),  # same wait, 1.5% of a 10 s step
        ({"perf/rollout_wait_s": 0.5}, GENERATION_BOUND),  # no step time: 0.1 s is the bar
        ({"rollout/backpressure_s": 0.05, "perf/rollout_wait_s": math.nan}, BALANCED),
        ({"reward": 1.0}, None),
        ({"perf/rollout_wait_s": math.nan, "rollout/backpressure_s": None}, None),
    ],
)
def test_classify_bottleneck(metrics, label):
    assert classify_bottleneck(metrics) == label


def test_generation_bound_line_points_at_generation_metrics():
    metrics = _queue(1.2, 0.0, **{"rollout/queue_size": 0.0, "batch/samples_per_step": 8.0})
    line = diagnose_bottleneck(metrics, FlowControl(4))
    assert line.startswith("generation-bound: training waited 1.20 s/step")
    assert "queue 0 samples = 0.0 steps" in line
    assert "rollout/generated_tokens_per_s" in line and "rollout/concurrency" in line


def test_trainer_bound_line_shows_queue_in_steps_and_staleness():
    metrics = _queue(0.0, 0.9, **{"rollout/queue_size": 32.0, "batch/samples_per_step": 8.0,
                                  "sample/staleness_mean": 3.6})  # fmt: skip
    line = diagnose_bottleneck(metrics, FlowControl(4))
    assert line.startswith("trainer-bound: generation waited 0.90 s")
    assert "queue 32 samples = 4.0 steps" in line and "staleness 3.6 of max 4" in line


def test_too_tight_line_says_raise_max_staleness():
    assert "raise staleness.max_staleness (now 2)" in diagnose_bottleneck(_queue(0.8, 0.7), FlowControl(2))
    assert "synchronous mode" in diagnose_bottleneck(_queue(0.8, 0.7), FlowControl(0))


def test_balanced_and_unknown_lines():
    assert diagnose_bottleneck(_queue(0.0, 0.0), FlowControl(4)).startswith("balanced:")
    assert diagnose_bottleneck({}, FlowControl(4)).startswith("bottleneck unknown")


def _config(**logging: object) -> Config:
    config = Config()
    config.trainer.max_steps = 10
    config.logging.console = "plain"
    for key, value in logging.items():
        setattr(config.logging, key, value)
    return config


def test_plain_output_is_one_line_per_step_with_the_numbers(capsys):
    console = Console(_config(), FlowControl(4))
    metrics = {"reward": 0.625, "reward_kept": 0.5, "reward_dropped": math.nan,
               "rollout/generated_tokens_per_s": 1234.4, "perf/wall_clock_trained_tokens_per_s": 567.0,
               "sample/staleness_mean": 1.25, "rollout/queue_size": 12.0, **_queue(0.0, 0.9)}  # fmt: skip
    console.log_step(3, metrics)
    console.log_step(4, {"reward": 0.75, "frac_reward_zero_std": 0.25, "reward_dropped": 1.0})
    console.finish(4, "/tmp/model", 12.4)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("step 3/10")
    for text in ("reward 0.625", "kept 0.500", "gen tok/s 1234", "train tok/s 567", "stale 1.25", "queue 12",
                 "trainer-bound"):  # fmt: skip
        assert text in lines[0]
    assert "dropped" not in lines[0]  # NaN is left out, not printed as nan
    assert lines[1] == "step 4/10  reward 0.750  dropped 25%  dropped_reward 1.000"  # a fraction, then a reward
    assert lines[2] == "done after 4 steps in 12 s; model saved to /tmp/model"


@pytest.mark.parametrize("mode", ["plain", "auto"])  # auto: pytest's captured stdout is no terminal
def test_output_without_a_terminal_never_wraps(capsys, mode):
    """rich broke lines at 80 columns off a terminal: the startup line's tail became a line of its own, the
    held-out summary four."""
    console = Console(_config(console=mode), FlowControl(4))
    long = "startup (seconds since launch): " + ", ".join(f"phase {i} {i}.5 s" for i in range(20))
    console.note(long)
    console.log_step(1, {"reward": 0.5, "rollout/server_0_request_count": 3.0, "rollout/server_1_request_count": 1.0,
                         **_queue(0.0, 0.9, **{"rollout/queue_size": 4.0, "sample/staleness_mean": 1.0})})  # fmt: skip
    console.finish(1, "/tmp/" + "a-long-directory-name/" * 6 + "model", 3.0)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and lines[0] == long and len(lines[1]) > 80, lines
    assert lines[1].startswith("step 1/10") and lines[2].startswith("done after 1 steps in 3 s")


def test_the_closing_line_after_a_resume_counts_this_launchs_steps_too(capsys):
    Console(_config(), FlowControl(4), start_step=30).finish(60, "/tmp/model", 125.2)
    assert capsys.readouterr().out == "done after 60 steps (30 in this launch) in 125 s; model saved to /tmp/model\n"


def test_a_long_evaluation_prints_its_progress_every_so_often_without_a_terminal(capsys):
    now = [100.0]
    console = Console(_config(), FlowControl(4), clock=lambda: now[0])
    with console.evaluating() as progress:
        for done in range(1, 201):
            now[0] += 0.5  # a completion every half second: 100 s for the greedy pass
            progress("greedy", done, 200)
        now[0] += EVAL_LINE_EVERY_S - 11  # the last line came at prompt 180, 10 s ago
        progress("sampled", 1, 200)  # 29 s after it: none yet
    with console.evaluating() as progress:  # a short evaluation prints nothing
        progress("greedy", 4, 4)
    assert capsys.readouterr().out.splitlines() == [
        f"held-out evaluation, greedy: {done}/200 completions" for done in (60, 120, 180)
    ]


def test_an_evaluation_on_a_terminal_shows_a_bar_that_goes_when_it_ends(capsys):
    console = Console(_config(console="live"), FlowControl(4))
    with console.evaluating() as progress:
        progress("sampled", 3, 8)
        console.live.refresh()
        assert len(console.progress.tasks) == 2  # training's and the evaluation's
    assert len(console.progress.tasks) == 1
    console.close()
    assert "held-out evaluation, sampled" in capsys.readouterr().out


def test_plain_output_counts_epochs_without_max_steps(capsys):
    config = _config()
    config.trainer.max_steps, config.trainer.num_train_epochs = -1, 3
    Console(config, FlowControl(4)).log_step(5, {"epoch": 1.5})
    assert capsys.readouterr().out.startswith("step 5  epoch 1.50/3")


def test_several_servers_show_their_share_of_requests_and_their_summed_load(capsys):
    metrics = {"rollout/server_0_request_count": 30.0, "rollout/server_1_request_count": 10.0,
               "rollout/vllm_kv_cache_usage_frac": 0.42, "rollout/vllm_running_requests": 12.0,
               "rollout/vllm_queued_requests": 0.0}  # fmt: skip
    assert servers_text(metrics) == "2 servers: requests 75%/25%  KV max 42%  running 12  queued 0"
    assert servers_text({"rollout/server_0_request_count": 3.0}) is None  # one server: nothing to compare
    Console(_config(), FlowControl(4)).log_step(1, metrics)
    assert "2 servers: requests 75%/25%" in capsys.readouterr().out


def test_live_mode_draws_progress_stats_and_bottleneck(capsys):
    console = Console(_config(console="live"), FlowControl(4))
    console.log_step(5, {"reward": 0.5, "frac_reward_zero_std": 0.5, "reward_dropped": 0.0, **_queue(0.0, 0.9)})
    console.close()
    out = capsys.readouterr().out
    assert "step 5/10" in out and "ETA" in out and "reward" in out and "trainer-bound" in out
    assert "dropped 50% of groups (their reward 0.000)" in out


def test_unknown_console_mode_names_the_key():
    with pytest.raises(ValueError, match="logging.console"):
        Console(_config(console="fancy"), FlowControl(4))


def _records(n: int) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": f"q{i}"}], "completion": f"answer-{i}", "reward": 1.0,
             "advantage": 0.5} for i in range(n)]  # fmt: skip


@pytest.mark.parametrize(("limit", "shown"), [(2, 2), (None, 5), (9, 5)])
def test_log_completions_respects_num_completions_to_print(capsys, limit, shown):
    console = Console(_config(log_completions=True, num_completions_to_print=limit), FlowControl(4))
    console.log_completions(_records(5))
    out = capsys.readouterr().out
    assert [i for i in range(5) if f"answer-{i}" in out] == list(range(shown))
    assert "user: q0" in out and "+0.500" in out and f"{shown} of 5" in out


def test_log_completions_shows_the_columns_reward_functions_added(capsys):
    records = [{**record, "golden_answer": f"gold-{i}"} for i, record in enumerate(_records(2))]
    Console(_config(log_completions=True), FlowControl(4)).log_completions(records)
    out = capsys.readouterr().out
    assert "golden_answer" in out and "gold-0" in out and "gold-1" in out


def test_log_completions_prints_nothing_unless_enabled(capsys):
    Console(_config(log_completions=False), FlowControl(4)).log_completions(_records(3))
    assert capsys.readouterr().out == ""
