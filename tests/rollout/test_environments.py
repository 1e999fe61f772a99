"""Environments: routing by the `environment` column, only that environment's tools, pooled reuse, rewards."""

from __future__ import annotations

import asyncio

import pytest
from datasets import Dataset

from asyncrl.data import DatasetError
from asyncrl.environments.counter import IncrementEnv
from asyncrl.rollout.environments import Agents, check_routing, environment_tools, load_factories


class GameEnv:
    created = 0

    def __init__(self) -> None:
        GameEnv.created += 1

    def reset(self, **kwargs: object) -> str:
        return "Reach the goal."

    def move(self, action: str) -> str:
        """
        Move.

        Args:
            action: Direction.
        """
        return action


def test_environment_tools_are_public_methods_without_reserved_hooks():
    assert [t.__name__ for t in environment_tools(IncrementEnv())] == ["increment"]


def test_routing_exposes_only_that_environments_tools_and_passes_the_row():
    agents = Agents([], {"counter": IncrementEnv, "game": GameEnv}, None)

    async def main():
        counter = await agents.begin({"prompt": [{"role": "user", "content": "Go."}], "environment": "counter",
                                      "target": 3})  # fmt: skip
        game = await agents.begin({"environment": "game"})
        return counter, game

    counter, game = asyncio.run(main())
    assert [t.__name__ for t in counter.tools] == ["increment"] and counter.env.target == 3
    assert counter.prompt == [{"role": "user", "content": "Go."}]
    assert [t.__name__ for t in game.tools] == ["move"]
    assert game.prompt == [{"role": "user", "content": "Reach the goal."}]  # no dataset prompt: reset supplies it
    with pytest.raises(KeyError, match="environment"):
        asyncio.run(agents.begin({"environment": "chess"}))


def test_instances_are_reused_and_rewards_name_the_class():
    GameEnv.created = 0
    agents = Agents([], {None: IncrementEnv}, None)
    games = Agents([], {None: GameEnv}, None)

    async def main():
        episode = await agents.begin({"prompt": [{"role": "user", "content": "Set 2."}], "target": 2})
        episode.tools[0](step=2)
        reward, seconds = await agents.end(episode)
        meanwhile = await agents.begin({"prompt": [{"role": "user", "content": "Set 3."}], "target": 3})
        agents.release([episode.env, None])
        again = await agents.begin({"prompt": [{"role": "user", "content": "Set 5."}], "target": 5})
        for _ in range(3):
            game = await games.begin({})
            await games.end(game)
            games.release([game.env])
        return episode, reward, seconds, meanwhile, again, await games.end(await games.begin({}))

    episode, reward, seconds, meanwhile, again, no_reward = asyncio.run(main())
    assert reward == (IncrementEnv, 1.0) and seconds >= 0 and episode.reset_s is not None
    assert meanwhile.env is not episode.env  # held until released: its group's reward functions read its state
    assert again.env is episode.env and again.env.counter == 0  # same instance, reset for the new episode
    assert GameEnv.created == 1 and no_reward == (None, None)


def test_load_factories_forms():
    assert load_factories(None) == {}
    assert load_factories("asyncrl.environments.counter:IncrementEnv") == {None: IncrementEnv}
    assert load_factories({"c": "asyncrl.environments.counter:IncrementEnv"}) == {"c": IncrementEnv}


def test_without_a_dataset_the_environment_supplies_each_prompt():
    from asyncrl.config.compose import compose, to_config
    from asyncrl.rollout.environments import environment_rows

    factory = "rollout.environment_factory=asyncrl.environments.counter:IncrementEnv"
    config = to_config(compose(["data.path=null", factory, "trainer.max_steps=5"]))
    assert config.data.path is None
    agents = Agents([], load_factories(config.rollout.environment_factory), None)

    async def main():
        return [await agents.begin(environment_rows()[0]) for _ in range(2)]

    episodes = asyncio.run(main())
    for ep in episodes:
        assert ep.prompt == [{"role": "user", "content": f"Set the counter to {ep.env.target}."}]
        assert 1 <= ep.env.target <= 9


def test_reset_that_returns_no_prompt_without_a_dataset_prompt_fails_naming_the_environment():
    agents = Agents([], {None: IncrementEnv}, None)
    with pytest.raises(ValueError, match="IncrementEnv.reset\\(target\\) returned no prompt"):
        asyncio.run(agents.begin({"prompt": [], "target": 3}))


def test_an_unknown_environment_in_the_data_fails_at_startup_naming_its_row():
    spec = {"counter": "asyncrl.environments.counter:IncrementEnv"}
    rows = Dataset.from_dict({"prompt": [[]] * 3, "environment": ["counter", "countr", "counter"]})
    with pytest.raises(DatasetError, match=r"'environment' has 'countr' \(row 1\), which names no environment of "
                                           r"rollout.environment_factory \(known: \['counter'\]\)"):  # fmt: skip
        check_routing(rows, spec)
    with pytest.raises(DatasetError, match="has no 'environment' column"):
        check_routing(rows.remove_columns("environment"), spec)
    check_routing(rows.select([0, 2]), spec)
    check_routing(rows, "asyncrl.environments.counter:IncrementEnv")  # one environment: no routing


class AsyncGameEnv:
    """Hooks that await their own I/O."""

    async def reset(self, level: int, **kwargs: object) -> str:
        await asyncio.sleep(0)
        self.level = level
        return f"Reach level {level}."

    async def get_reward(self) -> float:
        await asyncio.sleep(0)
        return float(self.level)


def test_async_reset_and_get_reward_are_awaited():
    agents = Agents([], {None: AsyncGameEnv}, None)

    async def main():
        episode = await agents.begin({"level": 2})
        return episode, await agents.end(episode)

    episode, (reward, _) = asyncio.run(main())
    assert episode.prompt == [{"role": "user", "content": "Reach level 2."}]  # not the str() of a coroutine
    assert reward == (AsyncGameEnv, 2.0)
