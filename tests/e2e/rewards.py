"""Reward functions the end-to-end tests name by import path (they must be importable in the worker)."""

from __future__ import annotations


def exploding_reward(prompts, completions, completion_ids, **columns):
    raise RuntimeError("reward server unreachable (deliberate test failure)")


def wrong_length_reward(prompts, completions, completion_ids, **columns):
    return [1.0] * (len(completions) + 1)


def none_reward(prompts, completions, completion_ids, **columns):
    return [None] * len(completions)


def string_reward(prompts, completions, completion_ids, **columns):
    return ["good"] * len(completions)


def eval_waits_for_the_worker_reward(prompts, completions, completion_ids, **columns):
    """Completion lengths; each process's first call waits (up to 60 s) until another process has scored too, and
    leaves `PID.met` or `PID.alone` in $ASYNCRL_TEST_SIGNAL_DIR. The trainer's first evaluation and the rollout
    worker both score with it: the trainer alone means no group was generated beside that evaluation."""
    import os
    import time
    from pathlib import Path

    signals, me = Path(os.environ["ASYNCRL_TEST_SIGNAL_DIR"]), str(os.getpid())
    if not any(signals.glob(f"{me}.*")):
        (signals / me).touch()
        deadline = time.monotonic() + 60

        def others() -> set[str]:
            return {p.name for p in signals.iterdir() if p.name.isdigit()} - {me}

        while not (met := others()) and time.monotonic() < deadline:
            time.sleep(0.1)
        (signals / f"{me}.{'met' if met else 'alone'}").touch()
    return [float(len(ids)) for ids in completion_ids]


TURNS_CONSTANT_CALLS: list[int] = []
"""The calls of ``turns_constant`` in this process (the worker scores one group a call)."""


def turns_constant(prompts, completions, completion_ids, *, after: int = 6, value: float = 1.0, **columns):
    """Spread over (0, 1) for this process's first ``after`` calls (groups that train), then ``value`` for every
    rollout: at 1.0 the model has solved the task (above every earlier reward), at 0.0 its groups have stopped carrying
    signal below it."""
    TURNS_CONSTANT_CALLS.append(len(completion_ids))
    if len(TURNS_CONSTANT_CALLS) > after:
        return [value] * len(completion_ids)
    return [(i + 1) / (len(completion_ids) + 1) for i in range(len(completion_ids))]


def episode_state(prompts, completions, completion_ids, environments, log_metric, target, **columns):
    """0.0 for each completion (the environment's own reward trains); logs where the counters ended. Raises unless
    each completion's instance still holds its own episode: the row's target, not a later episode's."""
    for env, wanted in zip(environments, target, strict=True):
        if env.target != int(wanted):
            raise AssertionError(f"an environment holds target {env.target}, its completion's row {wanted}")
    log_metric("episode/counter_mean", sum(env.counter for env in environments) / len(environments))
    return [0.0] * len(completions)


def image_reward(prompts, completions, completion_ids, **columns):
    """1 for each completion whose prompt holds its row's image, decoded (a PIL image in an image part): the reward
    functions see the conversation the model saw, as TRL's do; the row's image column comes along."""
    from PIL import Image

    def has_image(prompt) -> bool:
        parts = [part for message in prompt for part in (message["content"] if isinstance(message["content"], list)
                                                         else [])]  # fmt: skip
        return any(part.get("type") == "image" and isinstance(part.get("image"), Image.Image) for part in parts)

    assert all(value is not None for value in columns["image"]), "the row's image column reaches the reward functions"
    return [float(has_image(prompt)) for prompt in prompts]
