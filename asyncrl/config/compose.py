"""Compose the config tree (conf/ + recipes/) and turn it into a ``Config`` checked on its own fields.

Hydra owns composition, overrides and sweeps; this module gives it the schema (``base_config`` in the
ConfigStore), the ``${asset:NAME}`` resolver for files shipped with the package, and the conversion
from DictConfig to the typed ``Config`` that the rest of asyncrl reads. A run's plan (asyncrl/plan/assemble.py)
adds the checks that need more than the config and builds the components.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.errors import MissingConfigException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from asyncrl.assets import asset_path
from asyncrl.config.errors import ConfigError
from asyncrl.config.messages import check_known_keys
from asyncrl.config.schema import Config
from asyncrl.config.validate import validate

_PACKAGE_DIR = Path(__file__).resolve().parents[1]


def conf_dir() -> Path:
    """The config tree: inside the wheel (asyncrl/conf) or at the repo root for an editable install."""
    for candidate in (_PACKAGE_DIR / "conf", _PACKAGE_DIR.parent / "conf"):
        if (candidate / "config.yaml").is_file():
            return candidate
    raise FileNotFoundError(f"asyncrl config tree not found next to {_PACKAGE_DIR}")


def recipes_dir() -> Path:
    return conf_dir() / "recipe"


def _asset(name: str) -> str:
    return str(asset_path(name))


def register_schema() -> None:
    """Store the schema and resolvers once per process (Hydra and OmegaConf keep global registries)."""
    ConfigStore.instance().store(name="base_config", node=Config)
    if not OmegaConf.has_resolver("asset"):
        OmegaConf.register_new_resolver("asset", _asset)


def compose(overrides: list[str] | None = None, return_hydra_config: bool = False) -> DictConfig:
    """Compose conf/config.yaml with Hydra overrides (``key=value``, ``+recipe=NAME``, ``~key``); with
    ``return_hydra_config`` the result keeps Hydra's own node (``hydra.run.dir``, ...)."""
    register_schema()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3", job_name="asyncrl"):
        try:
            return hydra_compose(
                config_name="config", overrides=list(overrides or []), return_hydra_config=return_hydra_config
            )
        except MissingConfigException as exc:  # an option that does not exist: its message lists the real ones
            group = conf_dir() / Path(exc.missing_cfg_file).parent
            exc.options = [o for o in exc.options or [] if not is_preset(group / f"{o}.yaml", exc.options)]
            raise


def is_preset(option: Path, options: list[str]) -> bool:
    """A group's option that is another option with other values (the embedded default's ``loss/tiny_arith``
    extends ``clipped``, ``packing/tiny_arith`` sets ``name: tree``): no choice of its own to offer."""
    data = yaml.safe_load(option.read_text()) if option.is_file() else None
    if not isinstance(data, dict):
        return False
    extends = [entry for entry in data["defaults"] if entry in options] if "defaults" in data else []
    return bool(extends) or ("name" in data and data["name"] != option.stem and data["name"] in options)


def to_config(cfg: DictConfig) -> Config:
    """Resolve interpolations, build the typed Config and run the checks on its own fields."""
    check_known_keys(cfg)
    try:
        config = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as exc:
        raise ConfigError(str(exc)) from exc
    assert isinstance(config, Config)
    validate(config)
    return config


def to_yaml(config: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(config))
