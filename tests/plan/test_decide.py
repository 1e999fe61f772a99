"""The rules of the plan's decisions (plan/decide.py) not held by the plan's or the vLLM command's tests: the
server's context."""

from __future__ import annotations

from asyncrl.config.compose import compose, to_config
from asyncrl.plan.decide import max_model_len


def unmeasured() -> int:
    raise AssertionError("the prompts were measured, where the rule does not need them")


def test_vllms_context_is_the_longest_prompt_plus_one_turn_unless_set():
    config = to_config(compose(["server=vllm"]))
    assert max_model_len(config, "vllm", lambda: 24) == 24 + config.sampling.max_completion_length
    assert max_model_len(config, "builtin", unmeasured) is None  # the built-in server serves its model's context
    config.server.max_model_len = 300
    assert max_model_len(config, "vllm", unmeasured) == max_model_len(config, "builtin", unmeasured) == 300


def test_a_multi_turn_run_gets_the_models_whole_context():
    """The counter agent's later turns carry the earlier ones and the tool's answers: one turn's budget over the
    longest prompt (56 tokens) truncated every rollout to reward 0 on an H200."""
    agent = to_config(compose(["+recipe=counter_agent", "server=vllm"]))
    assert max_model_len(agent, "vllm", unmeasured) == 256  # tiny-counter's max_position_embeddings
    agent.server.max_model_len = 99
    assert max_model_len(agent, "vllm", unmeasured) == 99
