"""The console shows asyncrl's records and libraries' warnings; a library's INFO records reach the run's log file
only, httpx's (one per request) not even that, through the job logging that conf/config.yaml gives Hydra."""

from __future__ import annotations

import logging
import logging.config
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from asyncrl.config.compose import compose
from asyncrl.logs import PROGRESS_BAR_SWITCHES, ConsoleFilter, console_handler


def _record(name: str, level: int) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 0, "message", None, None)


def test_the_console_passes_asyncrl_and_library_warnings():
    keep = ConsoleFilter().filter
    assert keep(_record("asyncrl", logging.INFO)) and keep(_record("asyncrl.trainer", logging.INFO))
    assert keep(_record("httpx", logging.WARNING)) and keep(_record("__main__", logging.INFO))
    assert not keep(_record("httpx", logging.INFO)) and not keep(_record("asyncrlx", logging.INFO))
    assert not console_handler().filter(_record("httpx", logging.INFO))  # a trainer rank's console


@pytest.fixture
def restored_logging() -> Iterator[None]:
    """The root logger's handlers and level as they were, whatever the test configures."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    for handler in root.handlers:
        handler.close()
    root.handlers[:], root.level = handlers, level


def test_hydra_job_logging_keeps_library_info_in_the_file_only(tmp_path, capsys, restored_logging):
    job_logging = OmegaConf.to_container(compose(return_hydra_config=True).hydra.job_logging, resolve=False)
    job_logging["handlers"]["file"]["filename"] = str(tmp_path / "launch.log")
    logging.config.dictConfig(job_logging)
    assert not (tmp_path / "launch.log").exists()  # delayed: a job refused before its first record leaves none
    logging.getLogger("httpx").info("HTTP Request: POST http://127.0.0.1:8000/v1/completions")
    logging.getLogger("urllib3.connectionpool").info("loading weights")
    logging.getLogger("asyncrl.trainer").info("step 1")
    console, log = capsys.readouterr().out, (tmp_path / "launch.log").read_text()
    assert "step 1" in console and "loading weights" not in console and "HTTP Request" not in console
    assert "step 1" in log and "loading weights" in log and "HTTP Request" not in log


_LOAD = """
import os, sys
import transformers  # as in a job: the CLI's checks imported it
from asyncrl.logs import quiet_progress_bars
quiet_progress_bars()
import datasets
datasets.load_dataset("json", data_files=sys.argv[1], split="train", cache_dir=sys.argv[2])  # not cached yet
transformers.AutoModelForCausalLM.from_pretrained(sys.argv[3])
print(os.environ["HF_DATASETS_DISABLE_PROGRESS_BARS"], os.environ["HF_HUB_DISABLE_PROGRESS_BARS"])
"""


def test_no_library_progress_bar_reaches_the_console(tmp_path, arithmetic_data_dir, random_tiny_model_dir):
    """datasets' "Generating train split" and transformers' "Loading weights" bars (tqdm, on stderr) broke the
    console's lines (this load without ``quiet_progress_bars`` prints both); the switches, in the environment,
    reach the processes a job starts."""
    env = {k: v for k, v in os.environ.items() if k not in PROGRESS_BAR_SWITCHES} | {"HF_HUB_OFFLINE": "1"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    argv = [str(arithmetic_data_dir / "train.jsonl"), str(tmp_path), str(random_tiny_model_dir)]
    proc = subprocess.run([sys.executable, "-c", _LOAD, *argv], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Generating train split" not in proc.stderr and "Loading weights" not in proc.stderr, proc.stderr
    assert proc.stdout.split() == ["1", "1"]
