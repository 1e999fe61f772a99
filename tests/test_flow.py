"""The run's flow-control rules: synchronous mode, staleness, the token allowance, LoRA versions, and the trainer's
wait for expiring groups on a fake clock."""

from __future__ import annotations

import pytest

from asyncrl.config.errors import ConfigError
from asyncrl.config.schema import Config, LoraSync
from asyncrl.flow import FlowControl
from asyncrl.plan.assemble import check_adapter_slots
from asyncrl.serving.command import max_loras
from tests.fakes import FakeClock


def test_synchronous_mode_is_max_staleness_zero_and_grants_before_the_sync():
    assert FlowControl(0).synchronous and FlowControl(0).grant_before_sync()
    assert not FlowControl(1).synchronous and not FlowControl(1).grant_before_sync()


def test_a_sample_is_stale_past_max_staleness_syncs_and_at_its_last_chance_at_the_limit():
    flow = FlowControl(2)
    assert not flow.is_stale(sample_version=3, version=5) and flow.is_stale(sample_version=2, version=5)
    assert flow.last_chance_version(5) == 3
    assert FlowControl(0).is_stale(sample_version=4, version=5) and FlowControl(0).last_chance_version(5) == 5


def test_the_allowance_is_max_staleness_steps_of_what_a_step_consumed():
    assert FlowControl(3).initial_allowance(rows_per_step=4, token_budget=100) == 1200
    assert FlowControl(3).allowance(consumed=500, forwarded=350, rows_per_step=4, token_budget=100) == 1500
    assert FlowControl(3).allowance(consumed=0, forwarded=0, rows_per_step=4, token_budget=100) == 3


def test_a_synchronous_allowance_is_one_step_of_full_rows_at_the_packing_ratio_measured():
    flow = FlowControl(0)
    assert flow.initial_allowance(rows_per_step=4, token_budget=100) == 400
    # 500 sample tokens in 250 forwarded: full rows (400 tokens) hold 800, not the 500 this batch overshot to
    assert flow.allowance(consumed=500, forwarded=250, rows_per_step=4, token_budget=100) == 800


def test_lora_keeps_the_live_versions_and_the_server_one_more_slot():
    config = Config()
    config.staleness.max_staleness, config.lora.enabled, config.lora.sync = 2, True, LoraSync.adapter
    flow = FlowControl.from_config(config)
    assert (flow.live_versions, flow.adapter_slots) == (3, 4)
    assert max_loras(config, flow) == 4
    config.server.max_loras = 3
    with pytest.raises(ConfigError, match="server.max_loras=3 must be >= staleness.max_staleness \\+ 2 = 4"):
        check_adapter_slots(config, flow)


def test_from_config_reads_the_staleness_section_and_the_group_size():
    config = Config()
    config.staleness.max_staleness, config.staleness.max_concurrent_rollouts = 3, 64
    config.sampling.num_generations = 4
    assert FlowControl.from_config(config) == FlowControl(3, num_generations=4, max_concurrent_rollouts=64)


def test_a_step_may_wait_for_expiring_groups_as_long_as_the_last_step_took_without_its_own_wait():
    clock = FakeClock()
    wait = FlowControl(1, clock=clock).expiring_wait()
    wait.start_step()
    assert not wait.open()  # the first step has no step to time the wait by
    clock.advance(2.0)
    wait.start_step()  # the last step took 2 s
    clock.advance(1.5)
    assert wait.open()
    wait.held_back(since=clock() - 1.5)
    assert wait.waited_s == 1.5
    clock.advance(0.5)
    assert not wait.open()
    wait.start_step()  # 2 s, 1.5 of them waiting: this step may wait 0.5 s
    assert wait.waited_s == 0.0
    clock.advance(0.49)
    assert wait.open()
    clock.advance(0.01)
    assert not wait.open()
