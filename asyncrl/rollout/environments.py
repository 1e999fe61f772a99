"""Standalone tools and environments for one rollout: routing, pooled instances, reset and reward off the loop.

An environment is one instance per rollout, taken from a per-name pool (an expensive ``__init__`` is paid
once, ``reset`` starts each episode). Its public methods other than ``reset``/``get_reward`` are the
rollout's tools, next to the standalone ``rollout.tools``. ``__init__``, ``reset`` and ``get_reward`` run on
the tool pool so a slow environment only delays its own rollout; an ``async def`` ``reset`` or ``get_reward`` is
awaited on the rollout loop instead.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from asyncrl.registry import import_object
from asyncrl.rollout.tools import tool_name
from asyncrl.rollout.types import Messages

RESERVED = ("reset", "get_reward")
ROUTING_COLUMN = "environment"


def load_tools(paths: list[str]) -> list[Callable[..., Any]]:
    """``rollout.tools`` import paths -> functions; a name used twice is an error (the model calls by name)."""
    tools = [import_object(path) for path in paths]
    names = [tool_name(fn) for fn in tools]
    if len(set(names)) != len(names):
        raise ValueError(f"rollout.tools={paths}: two tools share a __name__ ({names})")
    return tools


def load_factories(spec: Any) -> dict[str | None, Callable[[], Any]]:
    """``rollout.environment_factory`` (an import path, or a name -> import path mapping) -> factories.

    A single factory is stored under the key None: every row uses it, no routing column needed."""
    if spec is None:
        return {}
    if isinstance(spec, str):
        return {None: import_object(spec)}
    if hasattr(spec, "items"):
        return {str(name): import_object(path) for name, path in spec.items()}
    raise TypeError(f"rollout.environment_factory={spec!r}: expected an import path or a mapping name -> path")


def check_routing(dataset: Any, spec: Any) -> None:
    """With a mapping of environments, every row's `environment` value must name one of them: checked at startup,
    not when the worker first reaches an unknown name mid-run."""
    from asyncrl.data import DatasetError

    factories = load_factories(spec)
    if not factories or None in factories:
        return
    columns = list(getattr(dataset, "column_names", None) or [])
    if ROUTING_COLUMN not in columns:
        raise DatasetError(f"rollout.environment_factory maps names to environments, but the dataset has no "
                           f"'{ROUTING_COLUMN}' column to route by (columns: {', '.join(columns)})")  # fmt: skip
    names = list(dataset[ROUTING_COLUMN])
    unknown = [name for name in dict.fromkeys(names) if name not in factories]
    if unknown:
        raise DatasetError(
            f"dataset column '{ROUTING_COLUMN}' has {unknown[0]!r} (row {names.index(unknown[0])}"
            + (f"; also {unknown[1:4]}" if unknown[1:] else "")
            + f"), which names no environment of rollout.environment_factory (known: {sorted(factories)})"
        )


def environment_tools(env: Any) -> list[Callable[..., Any]]:
    """The environment's public methods other than the reserved hooks, bound to the instance."""
    cls = type(env)
    public = [name for name in dir(cls) if not name.startswith("_") and name not in RESERVED]
    return [getattr(env, name) for name in public if inspect.isfunction(getattr(cls, name))]


def environment_rows() -> list[dict[str, Any]]:
    """The prompt stream when there is no dataset (data.path unset): one empty row, cycled; each rollout's
    ``reset()`` then samples its own task and returns the prompt."""
    return [{"prompt": []}]


@dataclass
class Episode:
    """One rollout's prompt and tools, and the environment instance it holds until ``Agents.release``."""

    prompt: Messages | str
    tools: list[Callable[..., Any]]
    env: Any = None
    env_key: str | None = None
    reset_s: float | None = None


class Agents:
    """Hands each rollout its prompt and tools; owns the environment pools."""

    def __init__(self, tools: list[Callable[..., Any]], factories: dict[str | None, Callable[[], Any]],
                 pool: Executor | None) -> None:  # fmt: skip
        self.tools, self.factories, self.pool = tools, factories, pool
        self._idle: dict[str | None, list[Any]] = defaultdict(list)
        self._keys: dict[int, str | None] = {}
        """Each instance's pool (its ``environment`` name), by id: instances live as long as the pools."""

    @classmethod
    def from_config(cls, config: Any, pool: Executor | None) -> Agents:
        return cls(load_tools(list(config.rollout.tools)), load_factories(config.rollout.environment_factory), pool)

    @property
    def enabled(self) -> bool:
        return bool(self.tools or self.factories)

    async def begin(self, row: dict[str, Any]) -> Episode:
        """Route the row, take an instance, ``reset(**row)``; a returned string extends the last user message. A
        standard (plain-text) prompt has neither tools nor environments (trainer/setup.py checks): it goes as it is."""
        if isinstance(row.get("prompt"), str):
            return Episode(row["prompt"], [])
        prompt = [dict(m) for m in row.get("prompt") or []]
        if not self.factories:
            return Episode(prompt, list(self.tools))
        key = self._route(row)
        env = self._idle[key].pop() if self._idle[key] else await self._off_loop(self.factories[key])
        self._keys[id(env)] = key
        kwargs = {k: v for k, v in row.items() if k not in ("prompt", ROUTING_COLUMN)}
        started = time.monotonic()
        text = await self._hook(functools.partial(env.reset, **kwargs))
        reset_s = time.monotonic() - started
        if text is not None:
            prompt = _append_to_user(prompt, str(text))
        if not prompt:
            raise ValueError(f"{type(env).__name__}.reset({', '.join(kwargs)}) returned no prompt and the row has "
                             "none: without a dataset prompt, reset() must return the task as a string")  # fmt: skip
        return Episode(prompt, [*self.tools, *environment_tools(env)], env, key, reset_s)

    async def end(self, episode: Episode) -> tuple[tuple[type, float] | None, float | None]:
        """((environment class, reward) or None, seconds in get_reward or None). The instance stays the rollout's
        until ``release``: the reward functions read its state as their ``environments`` argument."""
        get_reward = getattr(episode.env, "get_reward", None)
        if get_reward is None:
            return None, None
        started = time.monotonic()
        value = await self._hook(get_reward)
        return (type(episode.env), float(value)), time.monotonic() - started

    def release(self, envs: Iterable[Any]) -> None:
        """Put instances back in their pools, for the next rollouts' ``reset``: after their group is scored, or
        dropped."""
        for env in envs:
            if env is not None:
                self._idle[self._keys[id(env)]].append(env)

    def _route(self, row: dict[str, Any]) -> str | None:
        if None in self.factories:
            return None
        name = row.get(ROUTING_COLUMN)
        if name not in self.factories:
            raise KeyError(f"dataset column '{ROUTING_COLUMN}'={name!r} names no environment of "
                           f"rollout.environment_factory (known: {sorted(self.factories)})")  # fmt: skip
        return name

    async def _hook(self, fn: Callable[[], Any]) -> Any:
        """Call an environment hook: an ``async def`` one is awaited here (not its coroutine taken for its result),
        a plain one runs on the tool pool."""
        if inspect.iscoroutinefunction(fn):
            return await fn()
        return await self._off_loop(fn)

    async def _off_loop(self, fn: Callable[[], Any]) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn)


def _append_to_user(prompt: Messages, text: str) -> Messages:
    """``reset``'s string joins the last user message, or becomes the prompt when the row has none."""
    for message in reversed(prompt):
        if message.get("role") == "user":
            message["content"] = f"{message['content']}{text}" if message.get("content") else text
            return prompt
    return [*prompt, {"role": "user", "content": text}]
