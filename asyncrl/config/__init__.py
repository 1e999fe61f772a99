"""Configuration: typed schema (``schema``), Hydra composition (``compose``) and the cross-field checks on the
config's own fields (``validate``). The package imports nothing of asyncrl above it: the checks that need the
components, the servers or the trainer run where the run is planned (asyncrl/plan/)."""

from asyncrl.config.errors import ConfigError
from asyncrl.config.schema import Config

__all__ = ["Config", "ConfigError"]
