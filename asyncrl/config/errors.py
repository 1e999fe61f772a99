"""The error every configuration check raises: its own module, so that any layer can raise it without importing
the composition machinery."""


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the key and the fix."""
