"""What reaches the console from Python's logging: asyncrl's own records, and libraries' only from WARNING.

A library logging at INFO (httpx: one line per HTTP request, several per step and per rank) would drown the step
lines; the run's log file (launch.log) keeps them, httpx's excepted. Hydra's job logging installs ``ConsoleFilter``
on its console handler (conf/config.yaml); a trainer rank's console handler is ``console_handler()``.
"""

from __future__ import annotations

import logging

FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"
"""Hydra's console format, for the processes that Hydra does not configure."""


class ConsoleFilter(logging.Filter):
    """Passes asyncrl's records, and a library's from WARNING up."""

    def filter(self, record: logging.LogRecord) -> bool:
        own = record.name == "asyncrl" or record.name.startswith(("asyncrl.", "__main__"))
        return own or record.levelno >= logging.WARNING


def console_handler() -> logging.Handler:
    """A stderr handler in Hydra's format with ``ConsoleFilter``."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(FORMAT))
    handler.addFilter(ConsoleFilter())
    return handler
