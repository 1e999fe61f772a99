"""Configuration: typed schema (``schema``), Hydra composition (``compose``) and cross-field validation
(``validate``). The package itself imports only the schema and the error: importing ``asyncrl.config.schema``
runs this file first, and composition pulls in validation and through it the modules that read the schema."""

from asyncrl.config.errors import ConfigError
from asyncrl.config.schema import Config

__all__ = ["Config", "ConfigError"]
