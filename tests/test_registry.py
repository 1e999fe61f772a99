"""The registries: names, import paths, typed options built from YAML, and the errors users see."""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import StrEnum

import pytest

from asyncrl.registry import Component, ComponentRegistry, Registry, RegistryError, import_object


class Rounding(StrEnum):
    up = "up"
    down = "down"


@dataclass(frozen=True)
class ScaleOptions:
    factor: float = 2.0
    rounding: Rounding | None = None

    def __post_init__(self) -> None:
        if self.factor <= 0:
            raise ValueError(f"factor={self.factor} must be > 0")


class Widget(Component, ABC):
    @abstractmethod
    def __call__(self, values: list[float]) -> list[float]:
        """The widget's output."""


class Scale(Widget):
    Options = ScaleOptions

    def __call__(self, values: list[float]) -> list[float]:
        return [v * self.options.factor for v in values]


@pytest.fixture
def registry() -> ComponentRegistry:
    reg: ComponentRegistry = ComponentRegistry("widget", Widget)
    reg.register("scale")(Scale)
    return reg


def test_resolves_registered_name(registry):
    assert registry.get("scale") is Scale
    assert registry.names() == ["scale"]


def test_resolves_import_path(registry):
    assert registry.get(f"{Scale.__module__}:Scale") is Scale
    assert import_object("os.path:join") is import_object("os.path.join")


def test_build_makes_the_typed_options(registry):
    built = registry.build({"name": "scale", "factor": 3.0, "rounding": "up"})
    assert isinstance(built, Scale) and built([1.0]) == [3.0]
    assert built.options == ScaleOptions(3.0, Rounding.up) and built.options.rounding is Rounding.up
    assert registry.build("scale").options == ScaleOptions()


def test_unknown_name_lists_known_names(registry):
    with pytest.raises(RegistryError, match=r"unknown widget 'scael' \(known: scale"):
        registry.get("scael")


def test_unknown_option_lists_real_ones(registry):
    with pytest.raises(RegistryError, match=r"widget 'scale' has no parameter 'factr' \(has: factor, rounding\)"):
        registry.build({"name": "scale", "factr": 3.0})


def test_bad_option_values_fail_naming_the_component(registry):
    with pytest.raises(RegistryError, match=r"widget 'scale': rounding='sideways' must be one of up, down"):
        registry.build({"name": "scale", "rounding": "sideways"})
    with pytest.raises(RegistryError, match=r"widget 'scale': factor=0 must be > 0"):
        registry.build({"name": "scale", "factor": 0})


def test_only_components_of_the_kind_register_or_resolve(registry):
    with pytest.raises(RegistryError, match="widget 'join' is not a Widget subclass with an Options dataclass"):
        registry.register("join")(import_object("os.path:join"))
    with pytest.raises(RegistryError, match="widget 'os.path:join' is not a Widget subclass with an Options dataclass"):
        registry.get("os.path:join")


class Unfinished(Widget):
    """Forgot __call__."""


def test_a_component_missing_what_its_kind_defines_fails_naming_it(registry):
    """Checked where every entry is (registration and import-path lookup): the class never gets built."""
    with pytest.raises(RegistryError, match=r"widget 'unfinished' \(Unfinished\) must define __call__, as every"):
        registry.register("unfinished")(Unfinished)


def test_plain_function_options_are_its_named_parameters_other_than_call_arguments():
    """A reward's **columns receives dataset columns when it is called: a misspelt option must not vanish there."""

    def shaped(prompts, completions, *, scale: float = 1.0, **columns):
        return [scale] * len(completions)

    rewards: ComponentRegistry = ComponentRegistry("reward", Widget, call_arguments=("prompts", "completions"))
    rewards.register("shaped")(shaped)
    built = rewards.build({"name": "shaped", "scale": 0.5})
    assert isinstance(built, functools.partial) and built([], ["a"]) == [0.5]
    with pytest.raises(RegistryError, match=r"reward 'shaped' has no parameter 'scal' \(has: scale\)"):
        rewards.build({"name": "shaped", "scal": 0.5})
    with pytest.raises(RegistryError, match="has no parameter 'prompts'"):
        rewards.build({"name": "shaped", "prompts": []})


def test_bad_import_paths(registry):
    with pytest.raises(RegistryError, match="cannot import module 'no_such_module'"):
        registry.get("no_such_module:f")
    with pytest.raises(RegistryError, match="has no attribute 'nope'"):
        registry.get("os.path:nope")


def test_duplicate_registration_raises(registry):
    with pytest.raises(RegistryError, match="already registered"):
        registry.register("scale")(Scale)


def test_missing_name_key(registry):
    with pytest.raises(RegistryError, match="needs a 'name' key"):
        registry.build({"factor": 1.0})


def test_a_plain_registry_holds_any_named_object():
    backends: Registry = Registry("backend")
    backends.register("join")(import_object("os.path:join"))
    assert backends.get("join") is import_object("os.path:join") and "join" in backends


def test_builtin_registries_hold_their_components():
    from asyncrl.components import component_registries

    registries = component_registries()
    assert "accuracy" in registries["reward"]
    assert {"score_centering", "clipped"} <= set(registries["loss"].names())
    assert "group_zscore" in registries["advantage"]
    assert "flat" in registries["packing"]
