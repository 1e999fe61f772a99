"""The startup checks run against a live built-in server on the tiny model (tests/tiny.py)."""

from tiny import live_server, tiny_model_dir  # noqa: F401 (fixtures)
