"""compose -> run dir -> start server -> train -> tear down.

`run_hydra` hands the overrides to the single `@hydra.main` entry (Hydra's Compose API composes but
does not sweep). Each job writes its resolved config to the run directory, which is the only input
of every child process, starts the server under supervision and runs the trainer.
"""

from __future__ import annotations

import atexit
import errno
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import DictConfig

from asyncrl.config.compose import conf_dir, register_schema, to_config_and_components, to_yaml
from asyncrl.config.errors import ConfigError
from asyncrl.config.schema import Config

if TYPE_CHECKING:
    from asyncrl.components import Components
    from asyncrl.server.command import ServerCommand
    from asyncrl.server.group import ServerGroup

log = logging.getLogger("asyncrl")


def _expected_errors() -> tuple[type[BaseException], ...]:
    """Failures whose message says everything (bad data, a failed server or worker): no Python traceback."""
    from asyncrl.data import DatasetError
    from asyncrl.registry import RegistryError
    from asyncrl.rollout.spawn import UnpicklableError
    from asyncrl.server.process import ServerStartError
    from asyncrl.trainer.assembler import RolloutWorkerError
    from asyncrl.trainer.checkpoint import ResumeError
    from asyncrl.trainer.group_watch import TrainingStalledError
    from asyncrl.trainer.launcher import TrainerRankError
    from asyncrl.trainer.sync.base import WeightSyncError

    return (
        DatasetError,
        RegistryError,
        ServerStartError,
        RolloutWorkerError,
        UnpicklableError,
        TrainerRankError,
        ResumeError,
        TrainingStalledError,
        ConfigError,
        WeightSyncError,
    )


EXPECTED_ERRORS = _expected_errors()


def run_hydra(overrides: list[str], *, multirun: bool = False, cfg: str | None = None) -> None:
    import hydra

    register_schema()
    argv = [sys.argv[0], *overrides]
    if multirun:
        argv.append("--multirun")
    if cfg:
        argv += ["--cfg", cfg]
    entry = hydra.main(config_path=str(conf_dir()), config_name="config", version_base="1.3")(_hydra_job)
    saved, sys.argv = sys.argv, argv
    try:
        entry()
    finally:
        sys.argv = saved


def _hydra_job(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from asyncrl.config.messages import config_error_line

    try:
        config, components = to_config_and_components(cfg)
    except ConfigError as exc:
        print(f"config error: {config_error_line(exc)}", file=sys.stderr)
        raise SystemExit(2) from exc
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request drowns the metrics
    try:
        _run_restarting(cfg, config, components, run_dir)
    except EXPECTED_ERRORS as exc:
        details = getattr(exc, "details", "")
        log_to_file(f"{type(exc).__name__}: {exc}\n{details}", exc)
        first, _, rest = str(exc).partition("\n")  # a server's log tail follows the line
        print(f"error ({type(exc).__name__}): {first}{_see_log()}" + (f"\n{rest}" if rest else ""), file=sys.stderr)
        raise SystemExit(1) from exc
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        where = f" writing {exc.filename}" if exc.filename else ""
        again = resume_line(run_dir, Path(config.trainer.output_dir or run_dir))  # no log: the disk is full
        print(f"error (OSError): {exc.strerror}{where}: free space there; {again}", file=sys.stderr)
        raise SystemExit(1) from exc
    except KeyboardInterrupt as exc:
        log_to_file("interrupted", exc)
        print(interrupted_line(run_dir, Path(config.trainer.output_dir or run_dir), exc), file=sys.stderr)
        signum = getattr(signal, exc.args[0], signal.SIGINT) if exc.args else signal.SIGINT
        raise SystemExit(128 + signum) from exc
    if HydraConfig.get().mode == RunMode.MULTIRUN and config.logging.report:
        from asyncrl.report import write_report

        print(f"sweep report: {write_report(run_dir.parent)}", flush=True)  # updated as each job ends


def _run_restarting(cfg: DictConfig, config: Config, components: Components, run_dir: Path) -> None:
    """The job; after a process of it died, again from its newest good checkpoint, up to trainer.max_restarts
    times (asyncrl/restart.py)."""
    from asyncrl.restart import run_restarting

    first = iter([(config, components)])  # the first attempt runs as composed

    def attempt(resume: str | None) -> None:
        job = next(first, None) or _recomposed(cfg, resume, config.server.weights_dir)
        run_job(*job, run_dir)

    output_dir = Path(config.trainer.output_dir or run_dir)
    run_restarting(attempt, run_dir, output_dir, config.trainer.max_restarts,
                   resume=config.trainer.resume_from_checkpoint, report=_report_restart)  # fmt: skip


def _recomposed(cfg: DictConfig, resume: str | None, weights_dir: str | None) -> tuple[Config, Components]:
    """The job's config and fresh components for a restart: resuming from ``resume`` (None: from the start), with
    the server weights directory the first attempt claimed (removed at exit)."""
    import copy

    from omegaconf import open_dict

    again = copy.deepcopy(cfg)
    with open_dict(again):
        again.trainer.resume_from_checkpoint = resume
        again.server.weights_dir = weights_dir
    return to_config_and_components(again)


def _report_restart(line: str, exc: BaseException) -> None:
    log_to_file(line, exc)
    print(line, file=sys.stderr, flush=True)


def log_to_file(message: str, exc: BaseException) -> None:
    """``message`` and ``exc``'s traceback into the run's log files only (the terminal gets one line)."""
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, message, None, (type(exc), exc, exc.__traceback__))
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def _see_log() -> str:
    files = [h.baseFilename for h in logging.getLogger().handlers if isinstance(h, logging.FileHandler)]
    return f" (details: {files[0]})" if files else ""


def interrupted_line(run_dir: Path, output_dir: Path, exc: BaseException) -> str:
    """The step Ctrl-C or SIGTERM stopped at (the last one logged), and the command that resumes the run from its
    newest checkpoint: the run's own overrides, ``trainer.resume_from_checkpoint=latest`` and its directory."""
    from asyncrl.metrics import read_jsonl
    from asyncrl.trainer.checkpoint import list_checkpoints

    metrics = run_dir / "metrics.jsonl"
    steps = [r["step"] for r in read_jsonl(metrics)] if metrics.is_file() else []
    done = f"interrupted ({exc.args[0] if exc.args else 'SIGINT'}) at step {steps[-1] if steps else 0}"
    separator = "; " if list_checkpoints(output_dir) else ", "
    return done + separator + resume_line(run_dir, output_dir)


def resume_line(run_dir: Path, output_dir: Path) -> str:
    """How to continue the run: the command that resumes it from its newest checkpoint (the run's own overrides,
    ``trainer.resume_from_checkpoint=latest`` and its directory), or before one, the command that starts it again."""
    import shlex

    from hydra.core.hydra_config import HydraConfig

    from asyncrl.trainer.checkpoint import checkpoint_step, list_checkpoints

    kept = [
        o
        for o in HydraConfig.get().overrides.task
        if not o.lstrip("+~").startswith(("trainer.resume_from_checkpoint", "hydra.run.dir"))
    ]
    checkpoints = list_checkpoints(output_dir)
    if not checkpoints:
        return f"before its first checkpoint: nothing to resume; start again with: asyncrl train {shlex.join(kept)}"
    resume = [*kept, "trainer.resume_from_checkpoint=latest", f"hydra.run.dir={run_dir}"]
    return (
        f"resume from {checkpoints[-1].name} (step {checkpoint_step(checkpoints[-1])}) with: "
        f"asyncrl train {' '.join(shlex.quote(o) for o in resume)}"
    )


def run_job(config: Config, components: Components, run_dir: Path) -> None:
    """One training job in ``run_dir`` with the components its validation built: the server is stopped however
    the job ends."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if config.trainer.output_dir is None:
        config.trainer.output_dir = str(run_dir)
    from asyncrl.trainer.loop import run_training
    from asyncrl.trainer.ranks import world_size
    from asyncrl.trainer.setup import prepare

    world = world_size(config)
    _check_resume(config, run_dir)  # before config.yaml: a refused run leaves the directory as it was
    check_port(config)
    if config.server.launch:  # before config.yaml: the trainer ranks read the weights directory there
        claim_server_access(config, run_dir)
    (run_dir / "config.yaml").write_text(to_yaml(config))
    terminate_on_sigterm()
    prepared = prepare(config, components)  # data, picklability: fail before the server starts
    with start_server(config, run_dir, wait=False) as server:  # it boots while the trainer builds its model
        if world > 1:
            from asyncrl.trainer.launcher import run_ranks

            run_ranks(run_dir, server)  # the ranks read run_dir/config.yaml; rank 0 prepares again and waits for
            # the server's health after building its shard of the model
        else:
            from asyncrl.trainer.ranks import Ranks

            with Ranks.alone() as ranks:
                run_training(config, run_dir, server, prepared, ranks)
    if config.logging.report:
        from asyncrl.report import write_report

        print(f"report: {write_report(run_dir)}", flush=True)


def check_port(config: Config) -> None:
    """The port of a server to launch is free: otherwise the new server fails to bind, and the run would talk to
    whatever listens there."""
    from asyncrl.server.command import replica_port
    from asyncrl.server.process import port_is_free

    sv = config.server
    for replica in range(sv.replicas if sv.launch else 0):
        port = replica_port(config, replica)
        if not port_is_free(sv.host, port):
            which = f"server.port={sv.port}" if replica == 0 else f"server.port={sv.port} + replica {replica}"
            raise ConfigError(
                f"{which}: {sv.host}:{port} is already in use (another server?); choose a free one with "
                "server.port=N, or attach to it with server.launch=false"
            )


def _check_resume(config: Config, run_dir: Path) -> None:
    """Before anything loads: the checkpoint is whole and not under later checkpoints of another history; without
    resume, the directories hold no earlier run."""
    from asyncrl.trainer.checkpoint import (
        check_checkpoint,
        check_no_later_checkpoints,
        resolve_checkpoint,
    )

    spec = config.trainer.resume_from_checkpoint
    output_dir = Path(config.trainer.output_dir or run_dir)
    if not spec:
        _check_fresh(run_dir, output_dir)
        return
    resume = resolve_checkpoint(spec, output_dir)
    check_checkpoint(resume)
    check_no_later_checkpoints(resume, output_dir)


def _check_fresh(run_dir: Path, output_dir: Path) -> None:
    """Refuse to start a new run where an earlier one trained: its checkpoints would be replaced one by one, the
    later ones kept, and the metrics appended to, mixing two histories."""
    from asyncrl.trainer.checkpoint import ResumeError, list_checkpoints

    found = [path for path in (run_dir / "metrics.jsonl", output_dir / "model") if path.exists()]
    found += list_checkpoints(output_dir)[-1:]
    if found:
        raise ResumeError(
            f"{run_dir} already holds a run ({found[0]}): continue it with trainer.resume_from_checkpoint=latest, "
            "or train into a new directory (hydra.run.dir=...)"
        )


def load_run_config(run_dir: Path) -> tuple[Config, Components]:
    """The resolved config a job wrote to its run directory (what each of its child processes reads), and its
    components built by validating it."""
    from omegaconf import OmegaConf

    register_schema()
    cfg = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(run_dir / "config.yaml"))
    return to_config_and_components(cfg)  # type: ignore[arg-type]


def claim_server_access(config: Config, run_dir: Path) -> None:
    """The token and weights directory of a server this run launches. The token is $ASYNCRL_SERVER_TOKEN, else a
    fresh one put there: the environment (not argv, which ``ps`` shows every user) carries it to the server and to
    every process of the run, whose clients send it. Without server.weights_dir the server gets a fresh private
    directory (in /dev/shm when writable, else under the run directory), removed at exit; one left by a launcher
    killed outright (no exit handler ran) is removed by the next."""
    from asyncrl.client import ensure_token

    ensure_token()
    if config.server.weights_dir is None:
        shm = Path("/dev/shm")
        base = shm if shm.is_dir() and os.access(shm, os.W_OK) else run_dir
        base.mkdir(parents=True, exist_ok=True)
        remove_orphaned_transfer_dirs(base)
        config.server.weights_dir = tempfile.mkdtemp(prefix=f"{TRANSFER_PREFIX}{os.getpid()}-", dir=base)
        atexit.register(shutil.rmtree, config.server.weights_dir, ignore_errors=True)


TRANSFER_PREFIX = "asyncrl-transfer-"


def remove_orphaned_transfer_dirs(base: Path) -> None:
    """The weight-transfer directories in ``base`` whose launcher (the pid in their name) no longer exists."""
    for path in base.glob(f"{TRANSFER_PREFIX}*-*"):
        pid = path.name[len(TRANSFER_PREFIX) :].partition("-")[0]
        if pid.isdigit() and not _process_exists(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def launch_command(config: Config, run_dir: Path, replica: int = 0) -> ServerCommand:
    """The command of server ``replica`` this run launches, once its token and weights directory are claimed (one
    directory for every replica: a weight file is written once and each loads it). vLLM reads the token as its
    --api-key from VLLM_API_KEY (server/vllm.py says what that guards)."""
    from asyncrl.client import TOKEN_ENV
    from asyncrl.server.choice import server_command

    claim_server_access(config, run_dir)
    command = server_command(config, replica)
    if command.backend == "vllm":
        os.environ["VLLM_API_KEY"] = os.environ[TOKEN_ENV]
    return command


def start_server(config: Config, run_dir: Path, wait: bool = True) -> ServerGroup:
    """A context manager: the supervised servers (server.replicas of them), or handles on running ones when
    server.launch=false. ``wait=False``: launched servers are only started on entry; ``ready()`` waits for them."""
    from asyncrl.server.command import base_url, base_urls
    from asyncrl.server.group import ServerGroup
    from asyncrl.server.handle import AttachedServer, LaunchedServer

    timeout_s = config.server.timeout
    if not config.server.launch:
        return ServerGroup([AttachedServer(url, timeout_s=timeout_s) for url in base_urls(config)], wait)
    commands = [launch_command(config, run_dir, replica) for replica in range(config.server.replicas)]
    if commands[0].backend == "vllm":
        from asyncrl.server.vllm import trainer_gpus

        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(trainer_gpus(config))  # the servers' GPUs are in their env
    (run_dir / "commands").mkdir(exist_ok=True)
    servers = []
    for replica, command in enumerate(commands):
        name = "server" if len(commands) == 1 else f"server_{replica}"
        (run_dir / "commands" / f"{name}.sh").write_text(shell_line(command.argv, command.env))
        log_path = run_dir / "logs" / f"{name}.log"
        servers.append(LaunchedServer(command, base_url(config, replica), log_path, timeout_s, wait=False))
    return ServerGroup(servers, wait)


def serve_forever(config: Config) -> None:
    """`asyncrl serve`: the server in the foreground until Ctrl-C."""
    from asyncrl.client import TOKEN_ENV
    from asyncrl.server.command import base_url
    from asyncrl.server.handle import LaunchedServer
    from asyncrl.trainer.setup import check_model_path

    if config.server.replicas > 1:
        raise ConfigError(
            f"server.replicas={config.server.replicas}: asyncrl serve runs one server; start one per port "
            "(server.port=P) and attach the run to them with server.launch=false server.base_urls=[...]"
        )
    check_model_path(config)
    check_port(config)
    run_dir = Path(config.trainer.output_dir or "runs/serve")
    command = launch_command(config, run_dir)
    print(shell_line(command.argv, command.env), flush=True)
    terminate_on_sigterm()
    log_path = run_dir / "logs" / "server.log"
    try:  # Ctrl-C during startup stops the server too (the context manager's exit runs either way)
        with LaunchedServer(command, base_url(config), log_path, config.server.timeout) as server:
            print(f"serving {config.model.name_or_path} at {server.base_url} (log: {server.log_path})", flush=True)
            print(
                f"attach with: export {TOKEN_ENV}={os.environ[TOKEN_ENV]}; asyncrl train server.launch=false "
                f"server.base_url={server.base_url} server.weights_dir={config.server.weights_dir}",
                flush=True,
            )
            stopping = _stop_on_signals()
            while server.is_alive() and not stopping.wait(0.5):
                pass
    except KeyboardInterrupt:
        pass
    print("server stopped", flush=True)


def _stop_on_signals() -> threading.Event:
    """An event that SIGINT and SIGTERM set from now on. Raising KeyboardInterrupt instead could land inside
    ``Popen.poll`` between taking and releasing its waitpid lock, and the stop that follows could then never reap
    the server."""
    stopping = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stopping.set())
    return stopping


def terminate_on_sigterm() -> None:
    """Turn SIGTERM into KeyboardInterrupt("SIGTERM") so context managers stop the children; Ctrl-C raises it too,
    even in a process started from a script's background job, which inherits SIGINT ignored."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def shell_line(argv: list[str], env: dict[str, str]) -> str:
    import shlex

    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    return (prefix + " " if prefix else "") + " ".join(shlex.quote(a) for a in argv) + "\n"
