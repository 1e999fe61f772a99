"""Chaos run (CPU): one long run of the embedded default (`asyncrl train`, small overrides) while a driver injects
faults at random times and places, resumes after each, and checks the run's own files at the end.

Faults (``--kinds``): kill -9 / SIGTERM of the rollout worker, the server, a trainer rank (``--ranks 2``; with one
rank the trainer is the launcher) or the launcher (the CLI); a hung server (SIGSTOP until the run restarts it);
a full disk (the run directory is a small tmpfs, filled to the last byte for a few seconds); the newest
checkpoint corrupted (its weights cut in half) just before the worker dies; a network stall between the run and
its server (``net_stall``: the proxy below accepts but forwards nothing until the run restarts, then drops every
connection it held). Where the run restarts itself (trainer.max_restarts) the driver only waits; where the
launcher died it runs the printed resume command (for a kill -9, which prints nothing, the same command built from
the run's overrides).

The proxy: the run launches its own server as before (server.port = --port + 1), and its clients (rollout
worker, weight syncs, health watchdog) reach it through ``StallProxy`` at --port (server.base_url). A server the
driver started and the run attached to (server.launch=false) would take the run's own server start, stop and
restart out of every server fault; a proxy in front of the launched one keeps them all as they were. The proxy is
a thread of the driver, so it outlives every launch, and it is on the path of every fault, not only the stall.
(A launched server checks the port it listens on, not server.base_url's: asyncrl/serving/process.py.)

After the last fault the run is stopped (SIGTERM) and resumed with trainer.max_steps a few steps on, so that it
ends as every run does. The checks, from the run's files:

- prompts: the final checkpoint's rollout_state.json against the dataset (``--prompts`` rows of the arith set,
  few enough that the run completes epochs). Each prompt counted as consumed is counted once (trainer_state's
  prompts_consumed = the cursor + the prompts past it already consumed): one skipped would leave the cursor behind
  it for good. For each completed epoch (cursor past its last position), its positions map through the epoch's
  seeded order (asyncrl.rollout.worker.prompt_order) onto every dataset row exactly once; and the count of
  prompts consumed that each step of the kept history logged (its ``epoch`` x rows) never goes back across a
  resume and ends at the checkpoint's. Consumed = trained or dropped (a group with one reward for all is dropped).
- steps: metrics.jsonl's kept history (a resume from step S supersedes the rows past S written before it) holds
  each step 1..N once; the raw file's rows of superseded histories are reported apart.
- every checkpoint passes ``check_checkpoint`` and its weights, optimizer and RNG files load; the final model loads.
- orphans: no process of the run left after each fault's recovery and at the end, nothing left in /dev/shm.
  The driver runs in its own mount namespace with a private /dev/shm and the run directory on a tmpfs, so that
  the other users of a shared machine do not blur the count.
- weights: ``--baseline`` trains an uninterrupted run of the same number of steps; asynchronous sampling is not
  bit-deterministic, so the comparison is the distance between the two final updates relative to their size.

    python benchmarks/chaos.py --faults 100 --minutes 85 --seed 21  # the RESULTS.md run
    python benchmarks/chaos.py --faults 5 --kinds worker_kill,server_kill,launcher_kill
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from asyncrl.metrics import read_jsonl  # noqa: E402
from asyncrl.trainer.checkpoint import check_checkpoint, list_checkpoints  # noqa: E402

INSIDE = "ASYNCRL_CHAOS_INSIDE"
MARKER = "ASYNCRL_CHAOS_MARKER"
KINDS = ("worker_kill", "worker_term", "server_kill", "server_term", "server_hang", "rank_kill", "rank_term",
         "launcher_kill", "launcher_term", "disk_full", "corrupt_checkpoint", "net_stall")  # fmt: skip
RECOVERY_S = 300.0


class StallProxy:
    """A TCP proxy from 127.0.0.1:``port`` to 127.0.0.1:``target_port``, one thread per direction of each
    connection. ``stall()``: it still accepts, but forwards nothing, as a network that drops packets;
    ``release()``: every connection open during the stall is cut (TCP gives up on a long partition) and new ones
    flow again."""

    def __init__(self, port: int, target_port: int) -> None:
        self.target = ("127.0.0.1", target_port)
        self.listener = socket.create_server(("127.0.0.1", port))
        self.flowing = threading.Event()
        self.flowing.set()
        self.open: set[socket.socket] = set()
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, name="proxy", daemon=True).start()

    def stall(self) -> None:
        self.flowing.clear()

    def release(self) -> None:
        with self.lock:
            for sock in self.open:
                _shut(sock)
        self.flowing.set()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:  # closed at the end
                return
            threading.Thread(target=self._connect, args=(client,), daemon=True).start()

    def _connect(self, client: socket.socket) -> None:
        """Connect upstream once the network flows; a connection made during a stall is cut with it."""
        with self.lock:
            self.open.add(client)
        stalled = not self.flowing.is_set()
        self.flowing.wait()
        try:
            if stalled:
                return
            upstream = socket.create_connection(self.target, timeout=10)
            upstream.settimeout(None)
            with self.lock:
                self.open.add(upstream)
            back = threading.Thread(target=self._pump, args=(upstream, client), daemon=True)
            back.start()
            self._pump(client, upstream)
            back.join()
            with self.lock:
                self.open.discard(upstream)
            upstream.close()
        except OSError:
            pass
        finally:
            with self.lock:
                self.open.discard(client)
            client.close()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        """Bytes one way; what arrives during a stall, an end of stream too, waits, then goes nowhere (release
        cuts the socket)."""
        try:
            while data := source.recv(65536):
                self.flowing.wait()
                sink.sendall(data)
        except OSError:
            pass
        self.flowing.wait()
        _shut(sink)
        _shut(source)


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


@dataclass
class Fault:
    kind: str
    injected_at: float
    step: int
    outcome: str = "pending"
    """restarted (by the run itself) | relaunched (by the resume command) | absorbed (no stop) | lost"""
    lost_s: float = float("nan")
    """Seconds from the fault until the run trained past the step it had reached."""
    orphans: int = 0
    damaged: str = ""
    """corrupt_checkpoint only: "set aside" (the restart found it damaged and resumed from the one before) or
    "superseded" (the run saved a newer checkpoint before it stopped and resumed from that one)."""


@dataclass
class Run:
    """The CLI of the run under test, relaunched as needed; its processes carry MARKER in their environment."""

    run_dir: Path
    overrides: list[str]
    console: Path
    marker: str = field(default_factory=lambda: uuid.uuid4().hex)
    proc: subprocess.Popen[bytes] | None = None
    launches: int = 0
    read_offset: int = 0
    restarts_seen: int = 0
    printed_resume: list[str] | None = None
    """The overrides of the resume command the last launch printed (a Ctrl-C or SIGTERM)."""

    def start(self, args: list[str]) -> None:
        env = {**os.environ, MARKER: self.marker, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
        self.printed_resume = None
        with self.console.open("ab") as out:
            out.write(f"\n=== launch {self.launches}: asyncrl train {shlex.join(args)}\n".encode())
            command = [sys.executable, "-m", "asyncrl", "train", *args]
            self.proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                         start_new_session=True)  # fmt: skip
        self.launches += 1

    def resume(self, extra: list[str] = ()) -> None:  # type: ignore[assignment]
        """The resume command the CLI printed, else (a kill -9 prints nothing) the same built from the run's
        overrides: trainer.resume_from_checkpoint=latest in the run's directory. ``extra`` overrides replace."""
        self.poll_console()
        if list_checkpoints(self.run_dir):
            base = self.printed_resume or [*self.overrides, "trainer.resume_from_checkpoint=latest"]
        else:  # before a checkpoint: start again, as the restart does
            base = self.overrides
            metrics = self.run_dir / "metrics.jsonl"
            if metrics.is_file():
                metrics.rename(self.run_dir / "logs" / f"metrics.before_launch_{self.launches}.jsonl")
        keys = {e.partition("=")[0] for e in extra}
        self.start([o for o in base if o.partition("=")[0] not in keys] + list(extra))

    def poll_console(self) -> None:
        """Read the console's new lines: restart lines, and the resume command a stopped launch printed."""
        with self.console.open("rb") as f:
            f.seek(self.read_offset)
            chunk = f.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self.read_offset += len(complete)
        for line in complete.decode(errors="replace").splitlines():
            self.restarts_seen += line.startswith("restart ")
            if " with: asyncrl train " in line:  # Ctrl-C, SIGTERM, a full disk, a failure past a checkpoint
                self.printed_resume = shlex.split(line.split(" with: asyncrl train ", 1)[1])

    def pids(self, role: str) -> list[int]:
        return [pid for pid, r in processes(self.marker) if r == role]

    def exited(self) -> int | None:
        return None if self.proc is None else self.proc.poll()


def processes(marker: str) -> list[tuple[int, str]]:
    """(pid, role) of every live process with ``marker`` in its environment: launcher, server, rank_N, worker,
    other."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = (proc / "environ").read_bytes()
            if f"{MARKER}={marker}".encode() not in environ:
                continue
            if (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            found.append((int(proc.name), _role((proc / "cmdline").read_bytes(), environ)))
        except (FileNotFoundError, PermissionError, ProcessLookupError):
            continue
    return found


def _role(cmdline: bytes, environ: bytes) -> str:
    if b"asyncrl.engine" in cmdline:
        return "server"
    if b"asyncrl.trainer.rank_main" in cmdline:
        rank = [e for e in environ.split(b"\0") if e.startswith(b"LOCAL_RANK=")]
        return "rank_" + rank[0].split(b"=")[1].decode() if rank else "rank_?"
    if b"spawn_main" in cmdline:
        return "worker"
    if b"-m\0asyncrl\0train" in cmdline:
        return "launcher"
    return "other"


def signal_pids(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def last_step(run_dir: Path) -> int:
    """The step of metrics.jsonl's last complete row (read from its end: the file grows to megabytes)."""
    path = run_dir / "metrics.jsonl"
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 65536))
            lines = f.read().split(b"\n")
    except FileNotFoundError:
        return 0
    for line in reversed(lines[1:] if len(lines) > 1 else lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError):
            continue
    return 0


class Driver:
    def __init__(self, run: Run, kinds: list[str], rng: random.Random, ranks: int, proxy: StallProxy) -> None:
        self.run, self.kinds, self.rng, self.ranks, self.proxy = run, kinds, rng, ranks, proxy
        self.faults: list[Fault] = []
        self.damaged_seen = 0

    def wait_trained_past(self, step: int, timeout_s: float) -> bool:
        """Until a step past ``step`` is logged; the launcher's exit on the way is relaunched (once per exit)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if last_step(self.run.run_dir) > step:
                return True
            if self.run.exited() is not None:
                return False
            time.sleep(0.5)
        return False

    def inject(self, kind: str) -> Fault:
        fault = Fault(kind, time.monotonic(), last_step(self.run.run_dir))
        restarts_before, damaged_before = self._restart_lines(), self.damaged_seen
        role, sig = _target(kind, self.ranks)
        release: Callable[[], None] = lambda: None  # noqa: E731
        if kind == "disk_full":
            self._fill_disk_until_stopped()
        elif kind == "corrupt_checkpoint":
            corrupted = self._fresh_checkpoint()
            weights = corrupted / "model.safetensors"
            weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
            fault.injected_at, fault.step = time.monotonic(), last_step(self.run.run_dir)  # not the wait for it
            signal_pids(self.run.pids("worker"), signal.SIGKILL)  # a restart must now pass the damaged one over
        elif kind == "server_hang":
            hung = self.run.pids("server")
            signal_pids(hung, signal.SIGSTOP)
            release = lambda: signal_pids(hung, signal.SIGCONT)  # noqa: E731 (its pending SIGTERM then ends it)
        elif kind == "net_stall":
            self.proxy.stall()
            release = self.proxy.release
        else:
            signal_pids(self.run.pids(role), sig)
        fault.outcome = self._outcome(fault, restarts_before, release)
        if kind == "corrupt_checkpoint":
            fault.damaged = "set aside" if self.damaged_seen > damaged_before else "superseded"
        self.faults.append(fault)
        return fault

    def _fresh_checkpoint(self) -> Path:
        """The newest checkpoint, waiting up to 60 s for the next save: corrupted just after it is written, it is
        most likely still the newest when the run notices the dead worker and restarts (seen to lose that race 2
        times in 9 at random times: the queued samples train on and the next save supersedes it)."""
        newest = list_checkpoints(self.run.run_dir)[-1]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and self.run.exited() is None:
            if (latest := list_checkpoints(self.run.run_dir)[-1]) != newest:
                return latest
            time.sleep(0.05)
        return newest

    def _outcome(self, fault: Fault, restarts_before: int, release: Callable[[], None]) -> str:
        """Wait for the run to restart itself, or relaunch a run whose launcher ended (then ``release`` a hang or
        a stall); then for it to train past the step it had reached."""
        deadline = time.monotonic() + RECOVERY_S
        outcome = ""
        while time.monotonic() < deadline and not outcome:
            if self._restart_lines() > restarts_before:
                outcome = "restarted"
            elif self.run.exited() is not None:
                outcome = "relaunched"
            elif last_step(self.run.run_dir) > fault.step + 2 and fault.kind not in ("server_hang", "net_stall"):
                outcome = "absorbed"  # trained on without a stop
            time.sleep(0.2)
        release()
        fault.step = max(fault.step, last_step(self.run.run_dir))  # what the stopped attempt had trained
        for _ in range(3):  # a launch that ends on the way (a fault that stops the restarted run) is relaunched
            if outcome and self.run.exited() is not None:
                fault.orphans += self._reap()
                self.run.resume()
                outcome = "relaunched"
            if not outcome or self.wait_trained_past(fault.step, RECOVERY_S):
                break
        if not outcome or last_step(self.run.run_dir) <= fault.step:
            return "lost"
        fault.lost_s = time.monotonic() - fault.injected_at
        self._clear_damaged()
        return outcome

    def _restart_lines(self) -> int:
        self.run.poll_console()
        return self.run.restarts_seen

    def _reap(self) -> int:
        """Processes of the dead launcher still alive 30 s on (then killed): orphans."""
        deadline = time.monotonic() + 30
        while (left := processes(self.run.marker)) and time.monotonic() < deadline:
            time.sleep(0.2)
        signal_pids([pid for pid, _ in left], signal.SIGKILL)
        return len(left)

    def _fill_disk_until_stopped(self) -> None:
        """Fill the run directory's filesystem; free it once the run stopped or restarted, or after 20 s."""
        filler = self.run.run_dir.parent / "filler"
        stat = os.statvfs(self.run.run_dir)
        with open(filler, "wb") as f:
            try:
                os.posix_fallocate(f.fileno(), 0, stat.f_bavail * stat.f_frsize)
            except OSError:
                pass
        restarts = self._restart_lines()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and self.run.exited() is None and self._restart_lines() == restarts:
            time.sleep(0.2)
        filler.unlink()

    def _clear_damaged(self) -> None:
        """Checkpoints the restart set aside as damaged: counted, then deleted (the tmpfs is small)."""
        for path in (self.run.run_dir / "checkpoints").glob("*.damaged"):
            self.damaged_seen += 1
            shutil.rmtree(path)


def _target(kind: str, ranks: int) -> tuple[str, int]:
    what, _, how = kind.rpartition("_")
    sig = signal.SIGKILL if how == "kill" else signal.SIGTERM
    if what == "rank":
        return ("rank_1" if ranks > 1 else "launcher"), sig
    return what, sig


# ---- the checks -----------------------------------------------------------------------------------------------


def kept_history(rows: list[dict]) -> tuple[list[int], int]:
    """The steps of the history the run ended with, and the rows of superseded ones: a row whose step is not past
    the previous row's starts a resumed history, which supersedes the rows from that step on."""
    kept: list[int] = []
    superseded = 0
    for row in rows:
        while kept and kept[-1] >= row["step"]:
            kept.pop()
            superseded += 1
        kept.append(row["step"])
    return kept, superseded


def check_steps(run_dir: Path) -> dict:
    rows = read_jsonl(run_dir / "metrics.jsonl")
    kept, superseded = kept_history(rows)
    expected = list(range(1, kept[-1] + 1)) if kept else []
    return {"steps": len(kept), "steps_missing": len(set(expected) - set(kept)),
            "steps_duplicated": len(kept) - len(set(kept)), "rows_superseded": superseded,
            "restarts_logged": rows[-1].get("perf/restarts") if rows else None}  # fmt: skip


def check_prompts(run_dir: Path) -> dict:
    """The final checkpoint's prompt record against the dataset and the kept history (the module docstring)."""
    from omegaconf import OmegaConf

    from asyncrl.rollout.worker import prompt_order

    config = OmegaConf.load(run_dir / "config.yaml")
    rows = sum(1 for line in Path(config.data.path).read_text().splitlines() if line.strip())
    last = list_checkpoints(run_dir)[-1]
    consumed = json.loads((last / "trainer_state.json").read_text())["prompts_consumed"]
    rollout = json.loads((last / "rollout_state.json").read_text())
    cursor, done = rollout["prompt_index"], rollout.get("done_after_index", [])
    distinct = cursor + len(set(done))
    epochs = cursor // rows
    once = [sorted(prompt_order(rows, e, config.trainer.seed, config.data.shuffle).tolist()) == list(range(rows))
            for e in range(epochs)]  # fmt: skip
    logged = consumed_per_step(read_jsonl(run_dir / "metrics.jsonl"), rows)
    return {"dataset_rows": rows, "prompts_consumed": distinct, "epochs_completed": epochs,
            "epochs_each_row_once": f"{sum(once)}/{epochs}", "done_past_cursor": all(i > cursor for i in done),
            "consumed_goes_back": sum(b < a for a, b in zip(logged, logged[1:], strict=False)),
            "consumed_logged_at_end": logged[-1] if logged else None,
            "prompts_duplicated": consumed - distinct + len(done) - len(set(done)),
            "prompts_lost": max(0, distinct - consumed)}  # fmt: skip


def consumed_per_step(rows: list[dict], dataset_rows: int) -> list[int]:
    """Prompts consumed so far at each step of the kept history, from the ``epoch`` each step logs."""
    kept: list[dict] = []
    for row in rows:
        while kept and kept[-1]["step"] >= row["step"]:
            kept.pop()
        kept.append(row)
    return [round(row["epoch"] * dataset_rows) for row in kept if "epoch" in row]


def check_checkpoints(run_dir: Path) -> dict:
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    bad = []
    checkpoints = list_checkpoints(run_dir)
    for path in checkpoints:
        try:
            check_checkpoint(path)
            load_file(str(path / "model.safetensors"))
            for name in ("optimizer.pt", "rng_state.pt"):
                torch.load(path / name, weights_only=True)
        except Exception as exc:  # noqa: BLE001 (any failure is a finding)
            bad.append(f"{path.name}: {exc}")
    AutoModelForCausalLM.from_pretrained(run_dir / "model")
    return {"checkpoints": len(checkpoints), "checkpoints_bad": bad}


def checked(check, run_dir: Path) -> dict:  # type: ignore[no-untyped-def]
    """A check's figures, or the error that stopped it (a finding too)."""
    try:
        return check(run_dir)
    except Exception as exc:  # noqa: BLE001
        return {f"{getattr(check, '__name__', 'check')}_error": f"{type(exc).__name__}: {exc}"}


def compare_weights(chaos: Path, baseline: Path) -> dict:
    """The two final updates from the base model: their distance relative to the uninterrupted one's size, and
    their cosine."""
    import torch
    from safetensors.torch import load_file

    base = load_file(str(REPO / "asyncrl" / "assets" / "tiny-arith" / "model.safetensors"))
    a, b = load_file(str(chaos / "model.safetensors")), load_file(str(baseline / "model.safetensors"))
    da = torch.cat([(a[k].float() - base[k].float()).flatten() for k in sorted(base)])
    db = torch.cat([(b[k].float() - base[k].float()).flatten() for k in sorted(base)])
    return {"update_distance_rel": float((da - db).norm() / db.norm()),
            "update_cosine": float(torch.nn.functional.cosine_similarity(da, db, dim=0)),
            "update_norm_ratio": float(da.norm() / db.norm())}  # fmt: skip


# ---- the run --------------------------------------------------------------------------------------------------


def isolate(args: argparse.Namespace) -> int:
    """Run this script again in its own mount namespace: a private /dev/shm and a tmpfs run directory."""
    command = ["unshare", "--mount", "--propagation", "private", sys.executable, *sys.argv]
    return subprocess.call(command, env={**os.environ, INSIDE: "1"})


def mount_tmpfs(path: Path, size_mb: int) -> None:
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(path)], check=True)


def overrides(
    run_dir: Path, port: int, ranks: int, steps: int, data: Path, health_timeout: float, save_steps: int = 5
) -> list[str]:
    """The run's settings; its server listens on ``port`` + 1, its clients reach it through the proxy at ``port``.
    A tenth of the tiny recipe's learning rate: at 1e-4 the model learns the 500 prompts by step 70 (reward 0.99),
    then nearly every group has one reward for all and is dropped, and a step takes minutes."""
    return [f"trainer.max_steps={steps}", f"trainer.save_steps={save_steps}", "trainer.max_restarts=100000",
            "trainer.learning_rate=1e-5",
            "data.num_eval_prompts=0", "logging.report=false", "logging.console=plain", "server.timeout=30",
            f"server.health_timeout={health_timeout}", f"data.path={data}", f"trainer.num_processes={ranks}",
            f"server.port={port + 1}", f"server.base_url=http://127.0.0.1:{port}",
            f"hydra.run.dir={run_dir}"]  # fmt: skip


def write_dataset(path: Path, rows: int) -> Path:
    """The first ``rows`` rows of the arith training set (all of them for 0): few enough to finish epochs."""
    lines = (REPO / "asyncrl" / "assets" / "arith" / "train.jsonl").read_text().splitlines(keepends=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(lines[:rows] if rows else lines))
    return path


def finish(run: Run, finish_steps: int) -> int:
    """Stop the run (SIGTERM) and resume it to end ``finish_steps`` steps on; the final step."""
    signal_pids([run.proc.pid], signal.SIGTERM)
    run.proc.wait(timeout=120)
    end = last_step(run.run_dir) + finish_steps
    run.resume([f"trainer.max_steps={end}"])
    if run.proc.wait(timeout=600) != 0:
        raise SystemExit(f"the finishing launch failed: see {run.console}")
    return end


def baseline_run(work: Path, port: int, ranks: int, steps: int, console: Path, data: Path) -> Path:
    run = Run(work / "baseline", overrides(work / "baseline", port, ranks, steps, data, health_timeout=60.0), console)
    run.start(run.overrides)
    if run.proc.wait(timeout=3600) != 0:
        raise SystemExit(f"the baseline run failed: see {console}")
    return work / "baseline" / "model"


def table(faults: list[Fault], checks: dict) -> str:
    by_kind: dict[str, list[Fault]] = defaultdict(list)
    for f in faults:
        by_kind[f.kind].append(f)
    lines = ["| fault | injected | survived | restarted itself | relaunched | absorbed | orphans | s lost mean / max |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for kind, group in [*sorted(by_kind.items()), ("all", faults)]:
        lost = [f.lost_s for f in group if f.outcome != "lost"]
        n = {
            outcome: sum(f.outcome == outcome for f in group)
            for outcome in ("lost", "restarted", "relaunched", "absorbed")
        }
        span = f"{sum(lost) / len(lost):.1f} / {max(lost):.1f}" if lost else "-"
        orphans = sum(f.orphans for f in group)
        lines.append(f"| {kind} | {len(group)} | {len(group) - n['lost']} | {n['restarted']} | {n['relaunched']} | "
                     f"{n['absorbed']} | {orphans} | {span} |")  # fmt: skip
    lines.append("")
    lines.append("checks: " + json.dumps(checks))
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", type=int, default=100)
    parser.add_argument("--minutes", type=float, default=40.0, help="stop injecting after this long")
    parser.add_argument("--kinds", default=",".join(k for k in KINDS if not k.startswith("rank_")))
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--port", type=int, default=18650, help="the proxy's; the server takes the next one")
    parser.add_argument("--prompts", type=int, default=500, help="dataset rows (0: all 4,000): epochs must end")
    parser.add_argument("--gap", type=float, nargs=2, default=(1.0, 8.0), help="seconds of training between faults")
    parser.add_argument("--disk-mb", type=int, default=400, help="the run directory's tmpfs")
    parser.add_argument("--finish-steps", type=int, default=5)
    parser.add_argument("--save-steps", type=int, default=5, help="trainer.save_steps: a fault waits for a checkpoint")
    parser.add_argument("--health-timeout", type=float, default=60.0,
                        help="server.health_timeout: how long a network stall goes unnoticed")  # fmt: skip
    parser.add_argument("--cycle", action="store_true", help="take --kinds in turn instead of at random")
    parser.add_argument("--baseline", action="store_true", help="also train an uninterrupted run and compare")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "chaos-out")
    args = parser.parse_args()
    if os.environ.get(INSIDE) is None and shutil.which("unshare") and os.geteuid() == 0:
        return isolate(args)
    kinds = [k for k in args.kinds.split(",") if k != "disk_full" or os.environ.get(INSIDE)]  # needs the tmpfs
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise SystemExit(f"--kinds: unknown {unknown}; choose from {', '.join(KINDS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path("/tmp") / f"asyncrl-chaos-{os.getpid()}"
    isolated = os.environ.get(INSIDE) == "1"
    if isolated:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2g", "tmpfs", "/dev/shm"], check=True)
        mount_tmpfs(work, args.disk_mb)
    run_dir = work / "run"
    console = args.out / "console.log"
    console.write_text("")
    rng = random.Random(args.seed)
    data = write_dataset(work / "train.jsonl", args.prompts)
    run = Run(run_dir, overrides(run_dir, args.port, args.ranks, 100_000, data, args.health_timeout, args.save_steps),
              console)  # fmt: skip
    proxy = StallProxy(args.port, args.port + 1)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the cleanup below runs
    try:
        return chaos(args, run, kinds, rng, isolated, work, proxy)
    finally:
        proxy.listener.close()
        pids = [pid for pid, _ in processes(run.marker)]
        signal_pids(pids, signal.SIGCONT)
        signal_pids(pids, signal.SIGKILL)
        if isolated:  # the tmpfs goes with the namespace; its mount point would stay behind in /tmp
            subprocess.run(["umount", str(work)], check=False)
            shutil.rmtree(work, ignore_errors=True)


def chaos(args: argparse.Namespace, run: Run, kinds: list[str], rng: random.Random, isolated: bool, work: Path,
          proxy: StallProxy) -> int:  # fmt: skip
    """Inject the faults, finish the run, check it and print the table."""
    run_dir, console, started = run.run_dir, run.console, time.monotonic()
    run.start(run.overrides)
    driver = Driver(run, kinds, rng, args.ranks, proxy)
    if not driver.wait_trained_past(args.save_steps, RECOVERY_S):  # the first checkpoint exists before the first fault
        raise SystemExit(f"the run did not reach step {args.save_steps + 1}: see {console}")
    while len(driver.faults) < args.faults and time.monotonic() - started < args.minutes * 60:
        time.sleep(rng.uniform(*args.gap))
        kind = kinds[len(driver.faults) % len(kinds)] if args.cycle else rng.choice(kinds)
        fault = driver.inject(kind)
        print(f"fault {len(driver.faults)}: {kind} at step {fault.step}: {fault.outcome} ({fault.lost_s:.1f} s)",
              flush=True)  # fmt: skip
        (args.out / "faults.json").write_text(json.dumps([f.__dict__ for f in driver.faults], indent=1))
        if fault.outcome == "lost":
            break
    end = finish(run, args.finish_steps)
    orphans_end = driver._reap()
    checks = {"minutes": round((time.monotonic() - started) / 60, 1), "final_step": end,
              "damaged_checkpoints_set_aside": driver.damaged_seen, "orphan_processes_at_end": orphans_end,
              "dev_shm_left": sorted(os.listdir("/dev/shm")) if isolated else "not isolated"}  # fmt: skip
    for check in (check_steps, check_prompts, check_checkpoints):
        checks.update(checked(check, run_dir))
    if args.baseline:
        baseline = baseline_run(work, args.port, args.ranks, end, console, run_dir.parent / "train.jsonl")
        checks.update(checked(lambda _: compare_weights(run_dir / "model", baseline), run_dir))
    report = table(driver.faults, checks)
    print(report, flush=True)
    (args.out / "table.md").write_text(report + "\n")
    (args.out / "checks.json").write_text(json.dumps(checks, indent=1) + "\n")
    (args.out / "faults.json").write_text(json.dumps([f.__dict__ for f in driver.faults], indent=1))
    for name in ("metrics.jsonl", "logs", "config.yaml", "launch.log", "model"):
        source = run_dir / name
        if source.is_dir():
            shutil.copytree(source, args.out / name, dirs_exist_ok=True)
        elif source.is_file():
            shutil.copy(source, args.out / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
