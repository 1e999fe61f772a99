"""Admission arithmetic: one group until the first completes (or its rollouts at a bound), then the token allowance
and the cap; the worker's side of flow control combining it with the two caps, the scoring queue and synchronous
batches."""

from asyncrl.flow import FlowControl
from asyncrl.rollout.admission import MIN_KEPT_FRACTION, Admission, WorkerFlow


def test_one_group_at_a_time_until_the_first_completes():
    a = Admission(num_generations=4, max_concurrent_rollouts=512)
    assert a.wait_reason(allowance=10_000, tokens_consumed=0, concurrency_cap=512) is None
    a.on_group_start()
    assert a.wait_reason(10_000, 0, 512) == "first group"
    for _ in range(4):
        a.on_rollout_done(num_tokens=25)
    a.on_group_done(pushed_tokens=100, rollout_tokens=100)
    assert a.wait_reason(10_000, 0, 512) is None


def test_with_a_bound_on_a_rollout_the_first_groups_start_together_inside_the_allowance():
    """Before a group completes, rollouts in flight count at the bound (the shortest finish first: their mean
    would undercount the rest), so the first step's groups start at once, as many as the allowance holds."""
    a = Admission(num_generations=4, max_concurrent_rollouts=512, asynchronous=True, rollout_token_bound=100)
    for _ in range(3):  # 3 groups x 4 rollouts x 100 tokens = 1,200; a 4th would hold 1,600
        assert a.wait_reason(allowance=1_400, tokens_consumed=0, concurrency_cap=512) is None
        a.on_group_start()
    assert a.wait_reason(1_400, 0, 512) == "backpressure"
    for _ in range(3):  # three short rollouts of the first group: 30 tokens held for them, not 300
        a.on_rollout_done(num_tokens=10)
    assert a.inflight_tokens() == 900 and a.wait_reason(1_400, 0, 512) is None  # 930 + 400 <= 1,400
    a.on_rollout_done(num_tokens=10)
    a.on_group_done(pushed_tokens=40, rollout_tokens=40)  # a group completed: the mean (10) takes over
    assert a.inflight_tokens() == 80 and a.starting_rollout_tokens() == 10


def test_backpressure_counts_queued_and_in_flight_tokens():
    a = Admission(num_generations=4, max_concurrent_rollouts=512)
    a.on_group_start()
    for _ in range(4):
        a.on_rollout_done(num_tokens=25)  # mean rollout = 25 tokens
    a.on_group_done(pushed_tokens=100, rollout_tokens=100)
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
    a.on_group_done(40, 40)
    a.on_group_start()  # 4 in flight; another group would make 8 > 6
    assert a.wait_reason(10**9, 40, concurrency_cap=512) == "concurrency"
    assert a.wait_reason(10**9, 40, concurrency_cap=5) == "concurrency"


def test_a_group_larger_than_the_cap_still_starts_when_nothing_is_in_flight():
    a = Admission(num_generations=8, max_concurrent_rollouts=4)
    assert a.wait_reason(10**9, 0, 4) is None


def test_finished_rollouts_of_a_running_group_still_count_against_the_allowance():
    a = Admission(num_generations=4, max_concurrent_rollouts=512)
    a.on_group_start()
    for _ in range(4):
        a.on_rollout_done(num_tokens=25)
    a.on_group_done(pushed_tokens=100, rollout_tokens=100)
    a.on_group_start()
    for _ in range(3):  # 3 of 4 done; the 4th is a long tail: 1 x 25 in flight + 75 waiting for it
        a.on_rollout_done(num_tokens=25)
    assert a.wait_reason(allowance=200, tokens_consumed=0, concurrency_cap=512) == "backpressure"
    assert a.wait_reason(allowance=201, tokens_consumed=0, concurrency_cap=512) is None
    a.on_rollout_done(num_tokens=60)
    a.on_group_done(pushed_tokens=120, rollout_tokens=135)  # scored and queued: only its samples count now
    assert a.unqueued_tokens == 0
    assert a.wait_reason(allowance=221, tokens_consumed=0, concurrency_cap=512) is None
    assert a.wait_reason(allowance=220, tokens_consumed=0, concurrency_cap=512) == "backpressure"


def test_rollouts_in_flight_count_at_their_length_biased_size():
    a = Admission(num_generations=4, max_concurrent_rollouts=512)
    a.on_group_start()
    for tokens in (10, 30, 10, 30):
        a.on_rollout_done(tokens)
    a.on_group_done(pushed_tokens=80, rollout_tokens=80)
    a.on_group_start()
    # mean 20, but a rollout caught in flight is more likely a long one: E[L^2] / E[L] = 500 / 20 = 25 each
    assert a.inflight_tokens() == 100
    assert a.wait_reason(allowance=181, tokens_consumed=0, concurrency_cap=512) is None
    assert a.wait_reason(allowance=180, tokens_consumed=0, concurrency_cap=512) == "backpressure"


def one_group_queued() -> Admission:
    """Asynchronous admission with one finished group of 4 x 25 tokens queued."""
    a = Admission(num_generations=4, max_concurrent_rollouts=512, asynchronous=True)
    a.on_group_start()
    for _ in range(4):
        a.on_rollout_done(num_tokens=25)
    a.on_group_done(pushed_tokens=100, rollout_tokens=100)
    return a


def test_asynchronous_admission_keeps_the_next_group_inside_the_smallest_recent_grant():
    a = one_group_queued()
    # 100 queued + the next group's expected 100 must fit
    assert a.wait_reason(allowance=200, tokens_consumed=0, concurrency_cap=512) is None
    assert a.wait_reason(allowance=199, tokens_consumed=0, concurrency_cap=512) == "backpressure"
    # a larger grant does not help while a smaller one is among the last four: the next steps may be that small
    for allowance in (300, 301, 302):
        assert a.wait_reason(allowance, tokens_consumed=0, concurrency_cap=512) == "backpressure"
    assert a.wait_reason(allowance=303, tokens_consumed=0, concurrency_cap=512) is None
    # nothing held: a group starts whatever its size
    assert a.wait_reason(allowance=50, tokens_consumed=100, concurrency_cap=512) is None


def test_the_initial_allowance_leaves_the_window_at_the_first_grant():
    a = one_group_queued()
    assert a.wait_reason(allowance=150, tokens_consumed=0, concurrency_cap=512) == "backpressure"  # the guess
    # the first grant measured a step larger than the guess: the guess no longer bounds admission
    assert a.wait_reason(allowance=400, tokens_consumed=0, concurrency_cap=512) is None


def started_and_done(flow: WorkerFlow, tokens: int, pushed: int | None = None) -> None:
    """One group of ``tokens``-token rollouts generated and queued (``pushed`` sample tokens; all by default)."""
    flow.admission.on_group_start()
    for _ in range(flow.flow.num_generations):
        flow.admission.on_rollout_done(tokens)
    total = tokens * flow.flow.num_generations
    flow.admission.on_group_done(total if pushed is None else pushed, total)


def test_the_worker_says_what_it_waits_on_the_pacer_first_then_room_to_score():
    flow = WorkerFlow(FlowControl(1, num_generations=4, max_concurrent_rollouts=8))
    started_and_done(flow, tokens=10)
    assert flow.wait_reason(allowance=10**6, tokens_consumed=40, scoring_full=True).startswith("scoring")
    flow.admission.on_group_start()  # 4 in flight, another group fits the ceiling of 8
    assert flow.wait_reason(10**6, 40, scoring_full=False) is None
    assert flow.pacer is not None
    assert flow.on_group_queued(start_version=0, version=2)  # late: the cap falls to 70% of 8 in flight
    assert flow.pacing_cap == 5 and flow.wait_reason(10**6, 40, scoring_full=False) == "staleness pacing"
    flow.concurrency.adapt(4)  # the server's load allows fewer: that is the reason now
    assert flow.wait_reason(10**6, 40, scoring_full=False) == "concurrency"
    assert flow.rollout_counts() == (4, 4)


def test_a_synchronous_worker_closes_its_batch_at_the_allowance_and_counts_tokens_by_batch():
    flow = WorkerFlow(FlowControl(0, num_generations=2, max_concurrent_rollouts=8))
    assert flow.pacer is None and flow.on_group_queued(0, 5) is None
    started_and_done(flow, tokens=50)
    # the trainer pulled the batch's samples already, yet they count until the batch is closed
    reason = flow.wait_reason(allowance=100, tokens_consumed=100, scoring_full=False)
    assert reason == "backpressure" and flow.closes_batch(reason)
    assert not flow.batch_has_room(100)
    flow.start_batch()  # the weights moved
    assert flow.released(tokens_consumed=0) == 100 and flow.wait_reason(100, 0, scoring_full=False) is None
    started_and_done(flow, tokens=30, pushed=0)  # a dropped group leaves room under the same weights
    assert flow.batch_has_room(100)


def test_a_synchronous_batch_of_samples_per_step_is_whole_groups_sent_whatever_the_allowance():
    flow = WorkerFlow(FlowControl(0, num_generations=2, max_concurrent_rollouts=8, samples_per_step=6))
    assert flow.flow.batch_groups == 3 and FlowControl(2, 2, samples_per_step=6).batch_groups is None
    for _ in range(3):  # no "first group" wait, and an allowance of one token does not close the batch
        assert flow.wait_reason(allowance=1, tokens_consumed=0, scoring_full=False) is None
        flow.admission.on_group_start()
    reason = flow.wait_reason(allowance=1, tokens_consumed=0, scoring_full=False)
    assert reason == "backpressure" and flow.closes_batch(reason)  # three groups in flight make the batch
    for pushed in (40, 0, 40):  # the second group is dropped (zero_std): the batch has room for one more
        for _ in range(2):
            flow.admission.on_rollout_done(20)
        flow.admission.on_group_done(pushed, 40)
    assert flow.batch_has_room(1) and flow.wait_reason(1, 0, scoring_full=False) is None
    started_and_done(flow, tokens=20)
    assert not flow.batch_has_room(1) and flow.batch_groups_sent() == 3
    flow.start_batch()  # the weights moved
    assert flow.batch_groups_sent() == 0 and flow.wait_reason(1, 0, scoring_full=False) is None


def test_an_asynchronous_worker_waits_for_the_trainer_to_consume():
    flow = WorkerFlow(FlowControl(2, num_generations=2, max_concurrent_rollouts=8))
    started_and_done(flow, tokens=50)
    reason = flow.wait_reason(allowance=100, tokens_consumed=0, scoring_full=False)
    assert reason == "backpressure" and not flow.closes_batch(reason)
    assert flow.wait_reason(allowance=100, tokens_consumed=100, scoring_full=False) is None


def test_groups_dropped_for_zero_spread_count_at_the_share_of_tokens_the_trainer_kept():
    """Near convergence most groups are dropped: the tokens in flight count at the kept share of the last groups
    (at least MIN_KEPT_FRACTION), so the worker starts enough groups to feed the trainer the allowance."""
    a = one_group_queued()  # kept: 100 tokens queued
    assert a.kept_fraction() == 1.0
    a.on_group_start()  # consumed: 100 in flight and the next group's 100 count whole
    assert a.wait_reason(allowance=199, tokens_consumed=100, concurrency_cap=512) == "backpressure"
    for _ in range(4):
        a.on_rollout_done(num_tokens=25)
    a.on_group_done(pushed_tokens=0, rollout_tokens=100)  # dropped: zero_std
    assert a.kept_fraction() == 0.5
    for _ in range(2):  # 2 x 100 tokens in flight count as 100 (and the next group as 50)
        a.on_group_start()
    assert a.wait_reason(allowance=150, tokens_consumed=100, concurrency_cap=512) is None
    assert a.wait_reason(allowance=149, tokens_consumed=100, concurrency_cap=512) == "backpressure"
    for _ in range(40):  # a window of drops: the share never falls below the floor
        a.outcomes.append((100, False))
    assert a.kept_fraction() == MIN_KEPT_FRACTION
