"""Step assembly from the rollout queue: staleness and oversize drops, rows per step, the prompt cursor,
and a worker that fails or goes silent turning into an error instead of a hang."""

from __future__ import annotations

import time

import pytest

from asyncrl.flow import FlowControl
from asyncrl.losses.step import StepNorm
from asyncrl.metrics import MetricWindow
from asyncrl.packing import PACKERS
from asyncrl.rollout.channels import WorkerChannels
from asyncrl.rollout.types import EndOfBatch, PromptDone, RolloutSample, TrainingSequence
from asyncrl.trainer.assembler import PromptProgress, RolloutWorkerError, StepAssembler
from asyncrl.trainer.distributed import split_rows
from asyncrl.trainer.step_metrics import batch_metrics
from tests.fakes import FakeClock, scripted_channels


def sample(prompt_index: int, n_tokens: int = 10, version: int = 0) -> RolloutSample:
    seq = TrainingSequence(list(range(n_tokens)), [0] * 4 + [1] * (n_tokens - 4), [0.0] * n_tokens)
    return RolloutSample(
        seq,
        advantage=1.0,
        reward=1.0,
        group_id=prompt_index,
        row_index=prompt_index,
        prompt_index=prompt_index,
        model_version=version,
        rollout_id="r",
        queued_at=time.time(),
    )


def assembler(channels: WorkerChannels, *, budget: int = 25, rows: int = 2, max_staleness: int = 1,
              timeout_s: float = 60.0, dp: int = 1, samples_per_step: int | None = None,
              ) -> tuple[StepAssembler, PromptProgress, MetricWindow]:  # fmt: skip
    """An assembler on the channels' scripted rollout queue, timing its waits by that queue's fake clock."""
    factory, budget = PACKERS.build({"name": "flat"}).rows(budget)
    progress, window = PromptProgress(cursor=0), MetricWindow()
    flow = FlowControl(max_staleness, clock=channels.rollout_queue.clock)
    return (StepAssembler(channels, factory, budget, rows, flow, progress, window, lambda: None, timeout_s, dp=dp,
                          samples_per_step=samples_per_step), progress, window)  # fmt: skip


def put(channels: WorkerChannels, *items) -> None:
    for item in items:
        channels.send(item)


def test_rows_close_when_full_and_the_step_has_rows_per_step_rows():
    channels, _ = scripted_channels()
    asm, progress, _ = assembler(channels)
    put(channels, *(sample(i) for i in range(5)))
    step = asm.next_step()  # rows of 2 samples (20 of 25 tokens); the 5th sample waits for the next step
    assert [len(r.samples) for r in step.rows] == [2, 2]
    assert progress.cursor == 4
    assert channels.tokens_consumed == 40 and asm.held == 1


@pytest.mark.parametrize(("dp", "micro_batches"), [(1, 3), (2, 2)])
def test_samples_per_step_trains_that_many_samples_in_as_many_rows_as_they_take(dp, micro_batches):
    channels, _ = scripted_channels()
    asm, progress, _ = assembler(channels, rows=1, dp=dp, samples_per_step=5)  # rows=1 would allow one row
    put(channels, *(sample(i) for i in range(8)))
    step = asm.next_step()  # rows of 2 samples (20 of 25 tokens): 5 samples fill 3 rows
    assert sorted(len(r.samples) for r in step.rows) == [1, 2, 2] and len(step.samples) == 5
    assert len(step.placement) == micro_batches and all(len(m) == dp for m in step.placement)
    assert progress.cursor == 5 and asm.held == 3


def test_two_ranks_get_micro_batches_balanced_by_cost_and_an_idle_rank_a_filler():
    channels, _ = scripted_channels()
    asm, progress, _ = assembler(channels, dp=2)
    long, short, closer = sample(0, n_tokens=20), [sample(i, n_tokens=5) for i in (1, 2, 3)], sample(4, n_tokens=24)
    put(channels, long, *short, closer, EndOfBatch(0))
    step = asm.next_step()  # the 24-token sample fits neither row: the first micro-batch closes, it opens the 2nd
    assert [row.samples for row in step.rows] == [[long], short, [closer]]
    assert step.placement == [[0, 1], [2, None]]  # micro-batches of one row per rank; rank 1 has none in the 2nd
    assert step.final and progress.cursor == 5
    packed = [row.pack(0) for row in step.rows]
    work = split_rows(packed, step.placement, StepNorm())
    assert [[(row, weight) for row, weight in rank.rows] for rank in work] == [
        [(packed[0], 1.0), (packed[2], 1.0)], [(packed[1], 1.0), (packed[2], 0.0)]]  # fmt: skip
    costs = [row.attention_cost() for row in packed]
    assert costs[0] > 4 * costs[1]
    expected = (costs[0] + costs[2]) / ((costs[0] + costs[1]) / 2 + costs[2] / 2)
    assert batch_metrics(step, packed, 25)["batch/row_imbalance"] == pytest.approx(expected)


def test_one_rank_steps_report_balance_and_split_rejects_a_malformed_placement():
    channels, _ = scripted_channels()
    asm, _, _ = assembler(channels)
    put(channels, *(sample(i, n_tokens=n) for i, n in enumerate((20, 5, 10, 10, 5, 10))))
    step = asm.next_step()
    assert step.placement == [[0], [1]]
    packed = [row.pack(0) for row in step.rows]
    assert batch_metrics(step, packed, 25)["batch/row_imbalance"] == 1.0
    with pytest.raises(ValueError, match=r"split_rows: micro-batch \[None\] must name one row per rank \(1\)"):
        split_rows(packed, [[0], [None]], StepNorm())


def test_stale_and_oversize_samples_are_dropped_and_counted():
    channels, _ = scripted_channels()
    channels.model_version = 3
    asm, progress, window = assembler(channels, rows=1)
    put(channels, sample(0, version=1), sample(1, n_tokens=30, version=3), sample(2, version=2), sample(3, version=3),
        sample(4, version=3))  # fmt: skip
    step = asm.next_step()
    assert [s.prompt_index for s in step.samples] == [2, 3]
    metrics = window.reduce()
    assert metrics["sample/dropped_stale_count"] == 1 and metrics["batch/dropped_oversize_count"] == 1
    assert metrics["sample/staleness_max"] == 1


def test_prompt_cursor_counts_dropped_groups_and_waits_for_gaps():
    progress = PromptProgress(cursor=10)
    progress.mark(11)
    assert progress.cursor == 10
    progress.mark(10)
    assert progress.cursor == 12 and progress.consumed == 2


def test_synchronous_mode_takes_everything_up_to_the_end_of_batch():
    channels, _ = scripted_channels()
    asm, _, _ = assembler(channels, rows=1, max_staleness=0)
    put(channels, sample(0), sample(1), sample(2), PromptDone(3, "zero_std"), EndOfBatch(0))
    step = asm.next_step()
    assert len(step.samples) == 3 and not step.final


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_the_worker_ending_its_prompts_because_every_one_is_retired_ends_the_run_saying_so(max_staleness):
    """Retired prompts never generated: the watch ignores them. The end marker's line reaches the trainer, and ends
    a synchronous run too (whose batch markers otherwise never end it)."""
    channels, _ = scripted_channels()
    asm, progress, _ = assembler(channels, rows=1, max_staleness=max_staleness)
    put(channels, sample(0), PromptDone(1, "retired"), PromptDone(2, "retired"), EndOfBatch(0, solved="solved!"))
    step = asm.next_step()
    assert len(step.samples) == 1 and step.final and asm.solved == "solved!"
    assert progress.cursor == 3 and asm.watch.dropped == {}


def test_worker_failure_is_raised_as_its_line_with_the_traceback_as_details():
    channels, _ = scripted_channels()
    asm, _, _ = assembler(channels)
    channels.report_failure("RuntimeError: boom in reward", "Traceback (most recent call last):\n...")
    with pytest.raises(RolloutWorkerError, match="^the rollout worker failed: RuntimeError: boom in reward$") as err:
        asm.next_step()
    assert err.value.details.startswith("Traceback")


def test_a_worker_that_died_ends_the_next_step_though_its_samples_are_held():
    """Its samples would train steps that the restart from the last checkpoint throws away."""
    channels, _ = scripted_channels()
    asm, _, _ = assembler(channels)
    put(channels, *(sample(i) for i in range(12)))
    asm.next_step()
    assert asm.held > 0

    def dead() -> None:
        raise RolloutWorkerError("the rollout worker exited with code -9 without an error")

    asm.health_check = dead  # the trainer's check (trainer/loop.py::_check_processes) finding the worker gone
    with pytest.raises(RolloutWorkerError, match="exited with code -9"):
        asm.next_step()


def test_a_silent_worker_fails_naming_what_it_waited_on():
    channels, _ = scripted_channels()
    channels.set_status("waiting for 16 rollouts in flight")
    channels.heartbeat = time.time() - 10
    asm, _, _ = assembler(channels, timeout_s=1.0)
    with pytest.raises(RolloutWorkerError, match=r"no progress for \d+s(.|\n)*waiting for 16 rollouts in flight"):
        asm.next_step()


def test_the_oldest_policy_version_that_arrived_is_taken_first():
    channels, _ = scripted_channels()
    channels.model_version = 1
    asm, progress, window = assembler(channels, rows=1)
    put(channels, sample(0, version=1), sample(1, version=0), PromptDone(2, "zero_std"), sample(3, version=1),
        sample(4, version=0))  # fmt: skip
    step = asm.next_step()  # a row holds two: the version-0 samples, one sync from their limit, go first
    assert [s.prompt_index for s in step.samples] == [1, 4]
    assert asm.held == 2  # samples 0 and 3 wait for the next step
    assert 2 in progress.done and "sample/dropped_stale_count" not in window.reduce()


def test_a_sample_that_would_open_the_next_step_is_checked_at_that_steps_version():
    """The next step trains after a weight sync: a sample within the limit now may be past it then."""
    channels, _ = scripted_channels()
    channels.model_version = 1
    asm, _, window = assembler(channels, rows=1, max_staleness=2)
    put(channels, *(sample(i, version=0) for i in range(3)))
    first = asm.next_step()
    assert [s.prompt_index for s in first.samples] == [0, 1] and window.reduce()["sample/staleness_max"] == 1
    channels.model_version = 3  # two syncs later
    put(channels, sample(3, version=3), sample(4, version=3), EndOfBatch(3))
    second = asm.next_step()
    assert [s.prompt_index for s in second.samples] == [3, 4]
    reduced = window.reduce()
    assert reduced["sample/dropped_stale_count"] == 1 and reduced["sample/staleness_max"] == 0


def test_a_full_step_takes_one_more_micro_batch_of_samples_at_their_last_version():
    channels, _ = scripted_channels()
    channels.model_version = 1
    asm, _, window = assembler(channels, rows=1, max_staleness=1)
    put(channels, *(sample(i, version=0) for i in range(5)), sample(5, version=1))
    step = asm.next_step()  # rows hold two: [0, 1] fills the step, [2, 3] trains rather than expire, 4 cannot
    assert [[s.prompt_index for s in row.samples] for row in step.rows] == [[0, 1], [2, 3]]
    assert window.reduce()["batch/overflow_micro_batch_count"] == 1 and asm.held == 2
    channels.model_version = 2
    put(channels, sample(6, version=2), EndOfBatch(2))
    assert [s.prompt_index for s in asm.next_step().samples] == [5, 6]  # only one extra micro-batch: 4 expired
    assert window.reduce()["sample/dropped_stale_count"] == 1
    put(channels, *(sample(i, version=1) for i in (7, 8, 9, 10)), EndOfBatch(3))
    last = asm.next_step()  # the run's last step takes its extra micro-batch too, and says so
    assert last.final and len(last.rows) == 2 and window.reduce()["batch/overflow_micro_batch_count"] == 1


def after_one_step(elapsed_s: float) -> tuple[WorkerChannels, FakeClock, StepAssembler, MetricWindow]:
    """At version 2 with max_staleness 1, one step done ``elapsed_s`` ago: that time bounds the next step's wait
    for expiring groups. Sample 2 is held for the next step."""
    channels, clock = scripted_channels()
    channels.model_version = 2
    asm, _, window = assembler(channels, rows=1, max_staleness=1)
    put(channels, sample(0, version=2), sample(1, version=2), sample(2, version=2))
    asm.next_step()
    clock.advance(elapsed_s)
    return channels, clock, asm, window


def test_a_step_waits_for_a_group_still_generating_at_its_last_version_within_one_steps_time():
    channels, clock, asm, window = after_one_step(0.6)
    assert window.reduce()["sample/expiring_wait_s"] == 0  # the first step: nothing to time the wait by
    channels.publish_inflight({1: 1, 2: 3})  # a version-1 group is generating: it trains in this step or never
    put(channels, sample(3, version=2))

    def finish_the_group() -> None:
        put(channels, sample(4, version=1), sample(5, version=1))
        channels.publish_inflight({2: 3})

    channels.rollout_queue.at(0.2, finish_the_group)
    step = asm.next_step()
    assert [s.prompt_index for s in step.samples] == [4, 5]  # not the younger ones that arrived first
    assert window.reduce()["sample/expiring_wait_s"] == pytest.approx(0.2)

    clock.advance(1.0)  # this step took 0.2 s of waiting and 1 s besides
    channels.publish_inflight({1: 1})  # a group that never finishes: the step goes on after 1 s
    put(channels, sample(6, version=2))  # the sample that closes the step
    started = clock()
    step = asm.next_step()
    assert [s.model_version for s in step.samples] == [2, 2]
    waited = window.reduce()["sample/expiring_wait_s"]
    assert clock() - started == pytest.approx(waited) and waited == pytest.approx(1.0, abs=0.05)
    put(channels, sample(7, version=2), sample(8, version=2))
    started = clock()
    asm.next_step()  # the last step's time, without its own wait, bounds this one: the wait does not grow
    assert clock() - started < 0.1 and window.reduce()["sample/expiring_wait_s"] < 0.1


def test_no_wait_for_groups_past_saving_or_when_the_weights_do_not_move():
    channels, clock, asm, window = after_one_step(1.0)
    channels.publish_inflight({0: 1, 2: 1})  # the version-0 group's samples will be dropped whenever they come
    put(channels, sample(3, version=2), sample(4, version=2))
    started = clock()
    asm.next_step()
    assert clock() == started and window.reduce()["sample/expiring_wait_s"] == 0
    clock.advance(1.0)
    channels.publish_inflight({1: 1})  # at its last version if a sync followed this step, but none does
    put(channels, *(sample(i, version=1) for i in (5, 6, 7)))
    step = asm.next_step(sync_follows=False)
    assert clock() == started + 1.0 and [s.prompt_index for s in step.samples] == [5, 6]
    assert window.reduce()["batch/overflow_micro_batch_count"] == 0  # 7 can train at this version next step


def test_samples_still_in_the_queues_pipe_when_their_group_ends_join_the_step():
    """``put`` returns before the item reaches the pipe: the trainer counts what the worker sent."""
    channels, _, asm, _ = after_one_step(0.5)
    channels.publish_inflight({1: 1})
    put(channels, sample(3, version=2))

    def group_ends_with_its_samples_in_the_pipe() -> None:
        channels.rollout_queue.transit_s = 0.3  # sent now, through the pipe 0.3 s later
        put(channels, sample(4, version=1), sample(5, version=1))
        channels.publish_inflight({})

    channels.rollout_queue.at(0.1, group_ends_with_its_samples_in_the_pipe)
    assert [s.prompt_index for s in asm.next_step().samples] == [4, 5]
