"""Admission arithmetic: one group until the first completes, then the token allowance and the cap."""

from asyncrl.rollout.admission import Admission


def test_one_group_at_a_time_until_the_first_completes():
    a = Admission(num_generations=4, max_concurrent_rollouts=512)
    assert a.wait_reason(allowance=10_000, tokens_consumed=0, concurrency_cap=512) is None
    a.on_group_start()
    assert a.wait_reason(10_000, 0, 512) == "first group"
    for _ in range(4):
        a.on_rollout_done(num_tokens=25)
    a.on_group_done(pushed_tokens=100)
    assert a.wait_reason(10_000, 0, 512) is None


def test_backpressure_counts_queued_and_in_flight_tokens():
    a = Admission(num_generations=4, max_concurrent_rollouts=512)
    a.on_group_start()
    for _ in range(4):
        a.on_rollout_done(num_tokens=25)  # mean rollout = 25 tokens
    a.on_group_done(pushed_tokens=100)
    # 100 queued (nothing consumed) + 0 in flight < 150: may start
    assert a.wait_reason(allowance=150, tokens_consumed=0, concurrency_cap=512) is None
    a.on_group_start()  # 4 rollouts x 25 = 100 in flight: 200 >= 150
    assert a.wait_reason(150, 0, 512) == "backpressure"
    # the trainer consumed the queued 100: 0 + 100 < 150
    assert a.wait_reason(150, 100, 512) is None


def test_concurrency_cap_bounds_rollouts_in_flight():
    a = Admission(num_generations=4, max_concurrent_rollouts=6)
    a.on_group_start()
    a.on_rollout_done(10)
    a.on_rollout_done(10)
    a.on_rollout_done(10)
    a.on_rollout_done(10)
    a.on_group_done(40)
    a.on_group_start()  # 4 in flight; another group would make 8 > 6
    assert a.wait_reason(10**9, 40, concurrency_cap=512) == "concurrency"
    assert a.wait_reason(10**9, 40, concurrency_cap=5) == "concurrency"


def test_a_group_larger_than_the_cap_still_starts_when_nothing_is_in_flight():
    a = Admission(num_generations=8, max_concurrent_rollouts=4)
    assert a.wait_reason(10**9, 0, 4) is None
