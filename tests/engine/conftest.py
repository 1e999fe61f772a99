"""Fixtures for the built-in server tests: the tiny model, its saved directory, and a live server on it."""

from tiny import live_server, tiny_model, tiny_model_dir  # noqa: F401 (fixtures)
