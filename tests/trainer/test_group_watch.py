"""The watch that stops a run whose groups cannot train: counts in arrival order, reasons, rewards, failure rate;
and the one that ends a run whose groups are all solved as a success."""

from __future__ import annotations

import itertools
import json

import pytest

from asyncrl.rollout.solved import RewardRange
from asyncrl.trainer.group_watch import (
    FAILURE_WINDOW,
    GenerationFailingError,
    GroupWatch,
    TaskSolved,
    TrainingStalledError,
)


def test_consecutive_drops_stop_the_run_naming_reasons_and_rewards():
    watch = GroupWatch(max_consecutive_dropped=5, max_failed_fraction=1.0)
    for _ in range(3):
        watch.on_dropped("zero_std", ("length",), "length=0")
    watch.on_dropped("too_few_scorable", ("accuracy",), "accuracy=None for 8 of 8")
    with pytest.raises(TrainingStalledError) as info:
        watch.on_sample(group_id=7, drop_reason="oversize")
    message = str(info.value)
    assert not isinstance(info.value, GenerationFailingError)  # rewards without signal: a restart cannot help
    assert "no trainable group in the last 5 (rollout.max_consecutive_dropped_groups=5)" in message
    assert "zero_std 3 (rewards: length x3; last: length=0), too_few_scorable 1 (rewards: accuracy x1; last: " \
           "accuracy=None for 8 of 8), oversize 1" in message  # fmt: skip
    assert "\n" not in message


def test_a_trainable_group_resets_the_count_and_its_other_samples_count_once():
    watch = GroupWatch(max_consecutive_dropped=3, max_failed_fraction=1.0)
    for round_ in range(4):
        watch.on_dropped("zero_std")
        watch.on_dropped("stale")
        watch.on_sample(group_id=round_, drop_reason=None)
        watch.on_sample(group_id=round_, drop_reason="oversize")  # a fork of the same group: already counted
    assert watch.dropped == {}
    watch.on_dropped("zero_std")
    watch.on_dropped("zero_std")
    with pytest.raises(TrainingStalledError, match="last 3 .*: zero_std 2, stale 1"):
        watch.on_sample(group_id=9, drop_reason="stale")  # a new group whose samples all arrive stale: a drop


def test_none_never_stops_on_drops():
    watch = GroupWatch(max_consecutive_dropped=None, max_failed_fraction=1.0)
    for _ in range(10_000):
        watch.on_dropped("zero_std", ("length",))


def test_failures_stop_the_run_past_the_fraction_of_the_window_with_the_last_error():
    watch = GroupWatch(max_consecutive_dropped=None, max_failed_fraction=0.1)
    allowed = int(0.1 * FAILURE_WINDOW)
    for group in range(3 * FAILURE_WINDOW):  # one failure in ten groups: at the threshold, never past it
        if group % 10 == 0:
            watch.on_dropped("failed", detail=f"/v1/completions: HTTP 400: error {group}")
        else:
            watch.on_sample(group, None)
    for extra in range(allowed):  # now only failures: the window passes the fraction within a few groups
        try:
            watch.on_dropped("failed", detail=f"/v1/completions: HTTP 500: boom {extra}")
        except TrainingStalledError as error:
            assert isinstance(error, GenerationFailingError)  # a server fault: trainer.max_restarts restarts it
            assert str(error).startswith(f"{allowed + 1} of the last {FAILURE_WINDOW} groups failed to generate")
            assert "rollout.max_failed_group_fraction=0.1" in str(error)
            assert str(error).endswith(f"last error: /v1/completions: HTTP 500: boom {extra}")
            return
    pytest.fail("the failures never stopped the run")


def test_zero_fraction_stops_at_the_first_failure_and_one_early_failure_is_not_a_full_rate():
    with pytest.raises(TrainingStalledError, match="1 of the last 1 groups"):
        GroupWatch(None, 0.0).on_dropped("failed", detail="x")
    GroupWatch(None, 0.1).on_dropped("failed", detail="x")


GROUP_IDS = itertools.count(1000)


def learned_then(watch: GroupWatch, *rewards: float) -> None:
    """A trainable group whose rollouts scored ``rewards``, as its samples arrive."""
    group_id = next(GROUP_IDS)
    for reward in rewards:
        watch.on_sample(group_id=group_id, drop_reason=None, reward=reward)


def test_a_window_of_groups_all_at_the_highest_reward_of_the_run_is_a_solved_task():
    watch = GroupWatch(max_consecutive_dropped=3, max_failed_fraction=1.0)
    learned_then(watch, 0.0, 1.0, 2.0, 1.0)  # the rewards had spread: the model had something to learn
    watch.on_dropped("zero_std", ("accuracy", "format"), "accuracy=1, format=1", reward=2.0)
    watch.on_dropped("zero_std", ("accuracy", "format"), "accuracy=1, format=1", reward=2.0)
    with pytest.raises(TaskSolved) as info:
        watch.on_dropped("zero_std", ("accuracy", "format"), "accuracy=1, format=1", reward=2.0)
    assert str(info.value) == (
        "the task is solved for this model: 3 groups in a row scored 2 for every rollout (accuracy=1, format=1), the "
        "highest reward of the run; training ends here (rollout.stop_when_solved=false: end as a stall)"
    )


@pytest.mark.parametrize(
    ("before", "window", "why"),
    [
        ((), [("zero_std", 0.0)] * 3, "constant from the first group: no lower score beside it"),
        ((), [("zero_std", 1.0)] * 3, "a constant 1 the run never rose to: nothing says it is the top"),
        ((0.0, 1.0), [("zero_std", 0.0)] * 3, "all wrong after learning: below the top"),
        ((0.0, 1.0), [("zero_std", 0.5)] * 3, "stuck at a middle value"),
        ((0.0, 1.0), [("zero_std", 1.0), ("zero_std", 1.0), ("too_few_scorable", None)], "one group unscored"),
        ((0.0, 1.0), [("zero_std", 1.0), ("zero_std", 1.0), ("stale", None)], "one group too stale"),
        ((0.0, 0.5), [("zero_std", 0.5), ("zero_std", 0.5), ("zero_std", 0.0)], "two levels"),
    ],
)
def test_any_other_window_is_a_stall(before, window, why):
    watch = GroupWatch(max_consecutive_dropped=3, max_failed_fraction=1.0)
    learned_then(watch, *before)
    for reason, reward in window[:-1]:
        watch.on_dropped(reason, reward=reward)
    reason, reward = window[-1]
    with pytest.raises(TrainingStalledError, match="no trainable group in the last 3"):
        watch.on_dropped(reason, reward=reward)


def test_a_solved_window_is_a_stall_when_stop_when_solved_is_false_and_a_trainable_group_resets_it():
    watch = GroupWatch(max_consecutive_dropped=3, max_failed_fraction=1.0, stop_when_solved=False)
    learned_then(watch, 0.0, 1.0)
    watch.on_dropped("zero_std", reward=1.0)
    watch.on_dropped("zero_std", reward=1.0)
    learned_then(watch, 1.0, 0.0)  # a group with signal: the window starts again
    assert watch.levels == {} and watch.solved_line() is None
    watch.on_dropped("zero_std", reward=1.0)
    watch.on_dropped("zero_std", reward=1.0)
    assert watch.solved_line() is not None  # every drop so far is solved, the window is not full yet
    with pytest.raises(TrainingStalledError, match="zero_std 3"):
        watch.on_dropped("zero_std", reward=1.0)


def test_the_reward_range_survives_a_resume():
    """A checkpoint keeps the rewards seen: a resumed run whose groups are all solved at once still says so."""
    watch = GroupWatch(max_consecutive_dropped=2, max_failed_fraction=1.0)
    learned_then(watch, 0.0, 1.0)
    saved = json.loads(json.dumps(watch.rewards.to_json()))
    assert saved == [0.0, 1.0] and RewardRange().to_json() is None
    resumed = GroupWatch(max_consecutive_dropped=2, max_failed_fraction=1.0, rewards=RewardRange.from_json(saved))
    resumed.on_dropped("zero_std", reward=1.0)
    with pytest.raises(TaskSolved):
        resumed.on_dropped("zero_std", reward=1.0)
