"""The staleness pacer: scripted group completions move the cap on rollouts in flight."""

from __future__ import annotations

from asyncrl.flow import FlowControl
from asyncrl.rollout.admission import WorkerFlow
from asyncrl.rollout.pacing import StalenessPacer


def test_a_late_group_cuts_the_cap_to_70_percent_of_the_rollouts_in_flight_with_it():
    pacer = StalenessPacer(ceiling=64, flow=FlowControl(2, num_generations=8))
    assert not pacer.on_group_done(start_version=0, version=2, inflight=32, completed=8)  # at the limit: not late
    assert pacer.cap == 64 and pacer.late_groups == 0
    assert pacer.on_group_done(start_version=0, version=3, inflight=32, completed=16)
    assert pacer.cap == 28  # floor(0.7 x (32 others in flight + its own 8))
    assert pacer.late_groups == 1


def test_groups_that_started_before_the_cut_do_not_cut_again_until_the_pool_drained():
    pacer = StalenessPacer(ceiling=64, flow=FlowControl(1, num_generations=8))
    pacer.on_group_done(start_version=3, version=5, inflight=56, completed=8)
    assert pacer.cap == 44
    for n, start in enumerate((3, 4, 5), start=2):  # in flight at the cut (version 5): the old concurrency
        assert pacer.on_group_done(start_version=start, version=7, inflight=56 - 8 * n, completed=8 * n)
    assert pacer.cap == 44 and pacer.late_groups == 4
    # started after the sync that followed the cut: admitted under the new cap, so its lateness is news
    pacer.on_group_done(start_version=6, version=8, inflight=24, completed=40)
    assert pacer.cap == 22  # floor(0.7 x (24 + 8))


def test_the_cut_is_taken_from_the_cap_when_more_rollouts_run_than_it_allows():
    pacer = StalenessPacer(ceiling=512, flow=FlowControl(1, num_generations=8))
    pacer.on_group_done(start_version=0, version=2, inflight=600, completed=8)  # the KV cap had been above
    assert pacer.cap == 358  # floor(0.7 x 512)


def test_the_cap_grows_by_one_group_per_cap_many_completions_and_staleness_window():
    pacer = StalenessPacer(ceiling=40, flow=FlowControl(1, num_generations=8))
    pacer.on_group_done(start_version=0, version=2, inflight=16, completed=8)
    assert pacer.cap == 16
    caps = []
    for completed, version in [(16, 2), (24, 3), (32, 4), (40, 4), (48, 5), (56, 6), (64, 6), (72, 7), (80, 8),
                               (88, 9), (120, 12)]:  # fmt: skip
        pacer.on_group_done(start_version=version - 1, version=version, inflight=8, completed=completed)
        caps.append(pacer.cap)
    # after the cut (8 completed, version 2) growth needs 16 completions and 2 syncs: (24, 3) has one sync,
    # (32, 4) -> 24; then 24 and 2 syncs: (56, 6) -> 32; then 32 and 2 syncs: (88, 9) -> 40, the ceiling
    assert caps == [16, 16, 24, 24, 24, 32, 32, 32, 32, 40, 40]


def test_the_cap_never_falls_below_one_group():
    pacer = StalenessPacer(ceiling=64, flow=FlowControl(1, num_generations=8))
    for start in (0, 3, 6):  # each started after the previous cut
        pacer.on_group_done(start_version=start, version=start + 2, inflight=0, completed=8 * (start + 1))
        assert pacer.cap == 8
    small = StalenessPacer(ceiling=4, flow=FlowControl(1, num_generations=8))  # a group larger than the ceiling
    small.on_group_done(start_version=0, version=5, inflight=0, completed=8)
    assert small.cap == 4


def test_synchronous_mode_is_not_paced():
    flow = WorkerFlow(FlowControl(max_staleness=0, num_generations=8, max_concurrent_rollouts=64))
    assert flow.pacer is None and flow.pacing_cap == 64
    assert flow.on_group_queued(start_version=0, version=3) is None
