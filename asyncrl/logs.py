"""What reaches the console from Python's logging: asyncrl's own records, and libraries' only from WARNING.

A library logging at INFO (httpx: one line per HTTP request, several per step and per rank) would drown the step
lines; the run's log file (launch.log) keeps them, httpx's excepted. Hydra's job logging installs ``ConsoleFilter``
on its console handler (conf/config.yaml); a trainer rank's console handler is ``console_handler()``. Libraries'
progress bars (tqdm, straight to stderr) are switched off by ``quiet_progress_bars``.
"""

from __future__ import annotations

import logging
import os
import sys

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


PROGRESS_BAR_SWITCHES = ("HF_DATASETS_DISABLE_PROGRESS_BARS", "HF_HUB_DISABLE_PROGRESS_BARS")
"""datasets' bars ("Generating train split"), and huggingface_hub's, which transformers' follow ("Loading weights")."""


def quiet_progress_bars() -> None:
    """No library progress bar in this process and those it starts: a bar broke the console's step lines (and a
    live display). The environment reaches child processes and libraries imported later; one already imported
    gets its own switch. A switch the user set (``=0`` keeps the bars) is left as it is."""
    for name in PROGRESS_BAR_SWITCHES:
        os.environ.setdefault(name, "1")
    if os.environ["HF_DATASETS_DISABLE_PROGRESS_BARS"] == "1" and "datasets" in sys.modules:
        import datasets

        datasets.disable_progress_bars()
    if os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1":
        if "huggingface_hub" in sys.modules:
            from huggingface_hub.utils import disable_progress_bars

            disable_progress_bars()
        if "transformers" in sys.modules:  # its switch was read from huggingface_hub's as it was imported
            from transformers.utils import logging as transformers_logging

            transformers_logging.disable_progress_bar()
