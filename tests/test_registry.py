"""The generic registry: names, import paths, parameter binding and the errors users see."""

from __future__ import annotations

import functools

import pytest

from asyncrl.registry import Registry, RegistryError, import_object


def scale(values, *, factor: float = 2.0):
    return [v * factor for v in values]


@pytest.fixture
def registry() -> Registry:
    reg: Registry = Registry("widget")
    reg.register("scale")(scale)
    return reg


def test_resolves_registered_name(registry):
    assert registry.get("scale") is scale
    assert registry.names() == ["scale"]


def test_resolves_import_path(registry):
    assert registry.get("asyncrl.registry:import_object") is import_object
    assert import_object("os.path:join") is import_object("os.path.join")


def test_build_binds_parameters(registry):
    built = registry.build({"name": "scale", "factor": 3.0})
    assert isinstance(built, functools.partial)
    assert built([1.0]) == [3.0]


def test_unknown_name_lists_known_names(registry):
    with pytest.raises(RegistryError, match=r"unknown widget 'scael' \(known: scale"):
        registry.get("scael")


def test_unknown_parameter_lists_real_ones(registry):
    with pytest.raises(RegistryError, match=r"widget 'scale' has no parameter 'factr' \(has: values, factor\)"):
        registry.build({"name": "scale", "factr": 3.0})


def test_options_of_a_component_taking_call_time_kwargs_are_checked():
    """A reward's **columns receives dataset columns when it is called: a misspelt option must not vanish there."""

    def shaped(prompts, completions, *, scale: float = 1.0, **columns):
        return [scale] * len(completions)

    rewards: Registry = Registry("reward", call_arguments=("prompts", "completions"))
    rewards.register("shaped")(shaped)
    assert rewards.build({"name": "shaped", "scale": 0.5})([], ["a"]) == [0.5]
    with pytest.raises(RegistryError, match=r"reward 'shaped' has no parameter 'scal' \(has: scale\)"):
        rewards.build({"name": "shaped", "scal": 0.5})
    with pytest.raises(RegistryError, match="has no parameter 'prompts'"):
        rewards.build({"name": "shaped", "prompts": []})
    open_kwargs: Registry = Registry("widget")  # without call_arguments **kwargs takes any option
    open_kwargs.register("shaped")(shaped)
    open_kwargs.build({"name": "shaped", "scal": 0.5})


def test_bad_import_paths(registry):
    with pytest.raises(RegistryError, match="cannot import module 'no_such_module'"):
        registry.get("no_such_module:f")
    with pytest.raises(RegistryError, match="has no attribute 'nope'"):
        registry.get("os.path:nope")


def test_duplicate_registration_raises(registry):
    with pytest.raises(RegistryError, match="already registered"):
        registry.register("scale")(scale)


def test_missing_name_key(registry):
    with pytest.raises(RegistryError, match="needs a 'name' key"):
        registry.build({"factor": 1.0})


def test_builtin_registries_hold_their_components():
    from asyncrl.components import component_registries

    registries = component_registries()
    assert "accuracy" in registries["reward"]
    assert {"score_centering", "clipped"} <= set(registries["loss"].names())
    assert "group_zscore" in registries["advantage"]
    assert "flat" in registries["packing"]
