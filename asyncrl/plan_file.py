"""plan.json: the run plan as the file every process of a run reads (the launcher writes it, nothing else plans).

The launcher plans once (plan/assemble.py::plan_run) and writes the plan into the run directory before anything
starts; where a vLLM waits for the trainer's warm-up, it writes the plan again with its measured stage
(plan/assemble.py::measured) before that vLLM starts. The trainer's ranks, the ranks' launcher and a restart read it
back. The schema is ``RunPlan`` itself: each of its fields is a key of the file (the config through the config's own
typed schema, the flow rules, the GPU split, the server commands and the measured memory through their dataclasses),
checked on the way in, and nothing else is; the built components are not in it, each process builds its own from the
config.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import types
import typing
from dataclasses import fields
from enum import Enum
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from asyncrl.config.errors import ConfigError
from asyncrl.config.schema import Config
from asyncrl.run_plan import RunPlan

PLAN_FILE = "plan.json"
VERSION = 1
"""plan.json's format; a file of another version is refused (the run that wrote it is another release's)."""


class PlanFileError(ConfigError):
    """plan.json is missing, of another version, or does not match the schema: the message names the key."""


def plan_record(plan: RunPlan) -> dict[str, Any]:
    """The plan as plain JSON values: a key per field of ``RunPlan``, and the format's version."""
    record: dict[str, Any] = {"version": VERSION}
    for field in fields(plan):
        record[field.name] = _plain(getattr(plan, field.name))
    return record


def _plain(value: Any) -> Any:
    """A field's JSON value: the config as its YAML tree, other dataclasses as their compared fields (the flow rules
    without their clock), lists item by item, paths as strings, enums as their values."""
    if isinstance(value, Config):
        return OmegaConf.to_container(OmegaConf.structured(value), enum_to_str=True)
    if dataclasses.is_dataclass(value):
        return {field.name: _plain(getattr(value, field.name)) for field in fields(value) if field.compare}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, Enum):
        return value.value
    return value


def plan_from_record(record: dict[str, Any]) -> RunPlan:
    """The plan a record holds, each field checked against its type in ``RunPlan``; the config against the config's
    schema. A missing, unknown or mistyped key raises PlanFileError naming it."""
    if record.get("version") != VERSION:
        raise PlanFileError(f"{PLAN_FILE} version {record.get('version')!r}: this asyncrl reads version {VERSION}")
    hints = typing.get_type_hints(RunPlan)
    names = [field.name for field in fields(RunPlan)]
    unknown = sorted(record.keys() - {*names, "version"})
    missing = [name for name in names if name not in record]
    if unknown or missing:
        raise PlanFileError(f"{PLAN_FILE}: unknown keys {unknown}, missing keys {missing}")
    return RunPlan(**{name: _typed(name, record[name], hints[name]) for name in names})


def _typed(name: str, value: Any, hint: Any) -> Any:
    """``value`` as the field ``name`` of type ``hint`` holds it; PlanFileError when it is not of that type."""
    if hint is Config:
        return config_from_tree(value)
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    for option in options:
        if value is None and option is type(None):
            return None
        if option in (int, str, bool) and type(value) is option:
            return value
        if option is Path and isinstance(value, str):
            return Path(value)
        if isinstance(option, type) and issubclass(option, Enum) and value in {m.value for m in option}:
            return option(value)
        if typing.get_origin(option) is list and isinstance(value, list):
            return [_typed(f"{name}[{index}]", item, typing.get_args(option)[0]) for index, item in enumerate(value)]
        if typing.get_origin(option) is dict and isinstance(value, dict):  # JSON's keys are strings
            return {key: _typed(f"{name}.{key}", item, typing.get_args(option)[1]) for key, item in value.items()}
        if dataclasses.is_dataclass(option) and isinstance(value, dict):
            return _dataclass(name, value, option)
    raise PlanFileError(f"{PLAN_FILE}: {name}={value!r} is not a {hint}")


def _dataclass(name: str, value: dict[str, Any], cls: type) -> Any:
    """A dataclass field's value (the flow rules, the GPU split, a server command, the measured memory) from its
    compared fields, each checked."""
    hints = typing.get_type_hints(cls)
    names = [field.name for field in fields(cls) if field.compare]
    if sorted(value) != sorted(names):
        raise PlanFileError(f"{PLAN_FILE}: {name} has keys {sorted(value)}, expected {sorted(names)}")
    return cls(**{key: _typed(f"{name}.{key}", value[key], hints[key]) for key in names})


def config_from_tree(tree: Any) -> Config:
    """A resolved config's YAML tree (config.yaml, plan.json's config) as the typed Config: the schema checks every
    key and type; the cross-field checks ran when the launcher planned."""
    try:
        config = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.create(tree)))
    except OmegaConfBaseException as error:
        raise PlanFileError(f"{PLAN_FILE}: config: {error}") from error
    assert isinstance(config, Config)
    return config


def write_plan(plan: RunPlan, run_dir: Path) -> Path:
    """plan.json into ``run_dir``, atomically: a process that reads it meanwhile finds the old plan or the new one
    (the decided stage, or the plan with its measured stage), never part of one."""
    path = run_dir / PLAN_FILE
    text = json.dumps(plan_record(plan), indent=2) + "\n"
    with tempfile.NamedTemporaryFile("w", dir=run_dir, prefix=f".{PLAN_FILE}.", delete=False) as file:
        file.write(text)
    os.replace(file.name, path)
    return path


def read_plan(run_dir: Path) -> RunPlan:
    """The plan the launcher wrote into ``run_dir`` (what every process of the run reads instead of planning)."""
    path = run_dir / PLAN_FILE
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError as error:
        raise PlanFileError(f"{path}: no plan; a run directory gets one when `asyncrl train` starts a job") from error
    except json.JSONDecodeError as error:
        raise PlanFileError(f"{path}: not JSON ({error})") from error
    return plan_from_record(record)
