"""Configuration: typed schema, Hydra composition and cross-field validation."""

from asyncrl.config.compose import compose, conf_dir, to_config, to_config_and_components
from asyncrl.config.errors import ConfigError
from asyncrl.config.schema import Config

__all__ = ["Config", "ConfigError", "compose", "conf_dir", "to_config", "to_config_and_components"]
