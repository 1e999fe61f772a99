"""Running the real CLI in tests: a subprocess with a marker in its environment, so that every process it
started (server, rollout worker) can be found afterwards, whoever its parent is by then; and what a server
serves compared with a trained model."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

from asyncrl.client import ControlClient
from asyncrl.serving.process import port_is_free

REPO = Path(__file__).resolve().parents[2]


@dataclass
class CliRun:
    returncode: int
    output: str
    seconds: float
    marker: str
    pid: int | None = None


def free_port_pair() -> int:
    """A port P with P and P+1 free, below the kernel's ephemeral range: a run's two replicas bind P and P+1 seconds
    later, and a port from bind(0) is ephemeral, so any outgoing connection (the other test worker's) could take
    its neighbour meanwhile."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    while True:
        port = random.randrange(20000, low - 1)
        if port_is_free("127.0.0.1", port) and port_is_free("127.0.0.1", port + 1):
            return port


def marked_pids(marker: str) -> list[int]:
    """Processes whose environment carries ``marker`` (children inherit it)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if f"ASYNCRL_TEST_MARKER={marker}".encode() in (proc / "environ").read_bytes():
                state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    found.append(int(proc.name))
        except (FileNotFoundError, PermissionError, ProcessLookupError):
            continue
    return found


def wait_no_marked(marker: str, timeout_s: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (pids := marked_pids(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return pids


def cli_env(marker: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The CLI's environment; ``extra`` is added, its PYTHONPATH put before the repository's."""
    extra = dict(extra or {})
    path = os.pathsep.join([*filter(None, [extra.pop("PYTHONPATH", None)]), str(REPO)])
    return {**os.environ, "ASYNCRL_TEST_MARKER": marker, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false", **extra}  # fmt: skip


def run_cli(
    args: list[str], *, timeout_s: float = 600, cwd: Path | None = None, env: dict[str, str] | None = None
) -> CliRun:
    marker = uuid.uuid4().hex
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "asyncrl", *args], capture_output=True, text=True,
                          env=cli_env(marker, env), timeout=timeout_s, cwd=cwd or REPO)  # fmt: skip
    return CliRun(proc.returncode, proc.stdout + proc.stderr, time.monotonic() - started, marker)


def start_cli(
    args: list[str],
    *,
    cwd: Path | None = None,
    preexec_fn: Callable[[], object] | None = None,
    env: dict[str, str] | None = None,
) -> tuple[subprocess.Popen[str], str]:
    marker = uuid.uuid4().hex
    proc = subprocess.Popen([sys.executable, "-m", "asyncrl", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=cli_env(marker, env), cwd=cwd or REPO,
                            preexec_fn=preexec_fn)  # fmt: skip
    return proc, marker


PLAN_RECORDER = '''
"""Loaded by every Python process of the test's run: appends "pid function argv" to $PLAN_CALLS at each planning
call."""
import importlib.machinery
import os
import sys


class PlanCalls:
    def find_spec(self, name, path, target=None):
        if name != "asyncrl.plan.assemble":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            for function in ("plan_run", "build_plan"):
                setattr(module, function, recorded(getattr(module, function)))

        spec.loader.exec_module = exec_module
        return spec


def recorded(function):
    def call(*args, **kwargs):
        with open(os.environ["PLAN_CALLS"], "a") as log:
            log.write(f"{os.getpid()} {function.__name__} {' '.join(sys.argv)}\\n")
        return function(*args, **kwargs)

    return call


sys.meta_path.insert(0, PlanCalls())
'''


def plan_recorder(root: Path) -> tuple[dict[str, str], Path]:
    """The environment that loads ``PLAN_RECORDER`` (a sitecustomize.py under ``root``) into every Python process
    of a run started with it, and the file where it logs each call of asyncrl.plan.assemble's planning functions."""
    hooks, calls = root / "plan-hooks", root / "plan_calls.log"
    hooks.mkdir(parents=True, exist_ok=True)
    (hooks / "sitecustomize.py").write_text(PLAN_RECORDER)
    return {"PYTHONPATH": str(hooks), "PLAN_CALLS": str(calls)}, calls


def planners(calls: Path) -> dict[int, list[str]]:
    """pid -> the "function argv" lines it logged (none planned: an empty dict)."""
    found: dict[int, list[str]] = {}
    for line in calls.read_text().splitlines() if calls.exists() else []:
        pid, rest = line.split(" ", 1)
        found.setdefault(int(pid), []).append(rest)
    return found


def kill_marked(marker: str) -> None:
    for pid in marked_pids(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def served_vs_trained(base_url: str, model: torch.nn.Module) -> float:
    """Max |server logprob - local logprob| over a sampled completion (temperature 1: processed = raw)."""
    prompt = [3, 40, 41, 42, 43]
    body = {"model": ControlClient(base_url).served_model_name(), "prompt": prompt, "max_tokens": 12,
            "temperature": 1.0, "logprobs": 0, "seed": 7, "return_token_ids": True}  # fmt: skip
    choice = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    tokens, served = choice["token_ids"], choice["logprobs"]["token_logprobs"]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    trained = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
    return float((trained - torch.tensor(served)).abs().max())
