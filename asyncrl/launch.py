"""compose -> plan -> run dir -> start server -> train -> tear down.

`run_hydra` hands the overrides to the single `@hydra.main` entry (Hydra's Compose API composes but
does not sweep). Each job plans once (plan/assemble.py::plan_run) and writes the plan to the run directory
(plan.json, asyncrl/plan_file.py), which is the only input of every child process and of a restart; then it starts
the server under supervision and runs the trainer.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import logging
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from omegaconf import DictConfig

from asyncrl.config.compose import conf_dir, register_schema, to_yaml
from asyncrl.config.errors import ConfigError
from asyncrl.config.schema import Config
from asyncrl.hub_push import HubPushError, pushing
from asyncrl.plan.assemble import TRANSFER_PREFIX, plan_run
from asyncrl.plan_file import read_plan, write_plan
from asyncrl.trainer.exits import CONFIG_ERRORS, EXPECTED_ERRORS, terminate_on_sigterm

if TYPE_CHECKING:
    from asyncrl.footprint import TrainerMemory
    from asyncrl.run_plan import RunPlan, ServerCommand
    from asyncrl.serving.group import ServerGroup
    from asyncrl.serving.handle import LaunchedServer

log = logging.getLogger("asyncrl")

JOB_ERRORS = (*EXPECTED_ERRORS, HubPushError)
"""A job's expected failures: its processes' (trainer/exits.py) and the Hub push's after training."""


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


COMMAND_STARTED_ENV = "ASYNCRL_COMMAND_STARTED_AT"
"""time.time() when `asyncrl train` was entered (cli.py sets it), before its heavy imports."""


def job_origin(now: float) -> float:
    """Where a job's perf/startup_* and wall time count from: the command's start for its first job, so that the
    imports, composing and preflight checks its user waited through count too (14 s of a warm 124 s start on the
    GPU machine, session 40, were outside them); a sweep's later jobs count from their own start."""
    return float(os.environ.pop(COMMAND_STARTED_ENV, now))


TRITON_AUTOTUNE_CACHE_ENV = "TRITON_CACHE_AUTOTUNING"


def keep_triton_autotuning() -> None:
    """Triton's autotuners keep each kernel's chosen config in Triton's cache directory (Triton >= 3.4), so that a
    later run of the shape takes it instead of benchmarking every config again: fla's gated-DeltaNet kernels in the
    trainer's warm-up and vLLM's own. Triton reads it when a kernel's module is imported: set before any is, in the
    environment the trainer ranks and the servers inherit. A value already set (0 turns it off) is kept."""
    os.environ.setdefault(TRITON_AUTOTUNE_CACHE_ENV, "1")


def _hydra_job(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from asyncrl.logs import quiet_progress_bars

    now = time.time()
    keep_triton_autotuning()
    # trainer/loop.py's STARTED_ENV (perf/startup_* count from there) and JOB_STARTED_ENV (perf/startup_job_s)
    os.environ["ASYNCRL_STARTED_AT"], os.environ["ASYNCRL_JOB_STARTED_AT"] = str(job_origin(now)), str(now)
    quiet_progress_bars()  # Hydra has set the job's logging up: libraries' bars would break its lines
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        plan = plan_run(cfg, run_dir)  # a job's plan measures the prompts: a dataset error is a config error too
    except CONFIG_ERRORS as exc:
        _refuse(exc, run_dir)
    config = plan.config
    try:
        _run_restarting(cfg, plan, run_dir)
    except CONFIG_ERRORS as exc:
        _refuse(exc, run_dir)
    except JOB_ERRORS as exc:
        _fail(exc, run_dir, Path(config.trainer.output_dir or run_dir))
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        where = f" writing {exc.filename}" if exc.filename else ""
        again = resume_line(run_dir, Path(config.trainer.output_dir or run_dir))  # no log: the disk is full
        print(f"error (OSError): {exc.strerror}{where}: free space there; {again}", file=sys.stderr)
        raise SystemExit(1) from exc
    except KeyboardInterrupt as exc:
        line = interrupted_line(run_dir, Path(config.trainer.output_dir or run_dir), exc)
        log_to_file(line, exc)  # the run's launch.log keeps the resume command when the console's copy is lost
        print(line, file=sys.stderr)
        signum = getattr(signal, exc.args[0], signal.SIGINT) if exc.args else signal.SIGINT
        raise SystemExit(128 + signum) from exc
    if HydraConfig.get().mode == RunMode.MULTIRUN and config.logging.report:
        from asyncrl.report import write_report

        print(f"sweep report: {write_report(run_dir.parent)}", flush=True)  # updated as each job ends


def _refuse(exc: BaseException, run_dir: Path) -> NoReturn:
    """A configuration error in one line, exit code 2; the directory Hydra made for the job goes if still empty."""
    from asyncrl.config.messages import config_error_line

    print(f"config error: {config_error_line(exc)}", file=sys.stderr)
    _close_log_files(run_dir)
    with contextlib.suppress(OSError):
        run_dir.rmdir()
    raise SystemExit(2) from exc


def _fail(exc: BaseException, run_dir: Path, output_dir: Path) -> NoReturn:
    """An expected failure in one line, exit code 1: its type and message, where the traceback is, and the command
    that resumes the run once it has a checkpoint (``resume_after_failure``); launch.log gets the line too."""
    again = resume_after_failure(run_dir, output_dir)
    first, _, rest = str(exc).partition("\n")  # a server's log tail follows the line
    logged = [f"{type(exc).__name__}: {first}{again}", rest, getattr(exc, "details", "")]
    log_to_file("\n".join(part for part in logged if part), exc)
    line = f"error ({type(exc).__name__}): {first}{_see_log()}{again}"
    print(line + (f"\n{rest}" if rest else ""), file=sys.stderr)
    raise SystemExit(1) from exc


def _close_log_files(run_dir: Path) -> None:
    """Detach the job's log files in ``run_dir`` from the root logger: once the directory is gone, a later record in
    this process (the next job of a sweep, a caller that ran the CLI in-process) would try to create the file there."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).parent == run_dir:
            root.removeHandler(handler)
            handler.close()


def _run_restarting(cfg: DictConfig, plan: RunPlan, run_dir: Path) -> None:
    """The job; after a process of it died, again from its newest good checkpoint, up to trainer.max_restarts
    times (asyncrl/restart.py)."""
    from asyncrl.restart import run_restarting

    config = plan.config
    first = iter([plan])  # the first attempt runs as planned

    def attempt(resume: str | None) -> None:
        run_job(next(first, None) or resumed_plan(run_dir, resume), run_dir, cfg)

    output_dir = Path(config.trainer.output_dir or run_dir)
    run_restarting(attempt, run_dir, output_dir, config.trainer.max_restarts,
                   resume=config.trainer.resume_from_checkpoint, report=_report_restart)  # fmt: skip


def resumed_plan(run_dir: Path, resume: str | None) -> RunPlan:
    """The job's plan for a restart: the one the first attempt wrote (plan.json: its decisions and the server
    weights directory it claimed, removed at exit), with fresh components, resuming from ``resume`` (None: from the
    start)."""
    plan = read_plan(run_dir)
    plan.config.trainer.resume_from_checkpoint = resume  # a config read just now, shared with no one yet
    return plan


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


def resume_after_failure(run_dir: Path, output_dir: Path) -> str:
    """What the error line of a failed run adds: with a checkpoint, "; " and the command that resumes from it (a
    dead or hung server, worker or rank, an out-of-memory: whatever failed, the run goes on from there once it is
    fixed); before one, nothing (the error is the whole story, and the run's own command starts it again)."""
    from asyncrl.trainer.checkpoint import list_checkpoints

    return f"; {resume_line(run_dir, output_dir)}" if list_checkpoints(output_dir) else ""


def resume_line(run_dir: Path, output_dir: Path) -> str:
    """How to continue the run (``continue_line``) with the run's own overrides."""
    from hydra.core.hydra_config import HydraConfig

    kept = other_overrides(list(HydraConfig.get().overrides.task), ("trainer.resume_from_checkpoint", "hydra.run.dir"))
    return continue_line(kept, run_dir, output_dir)


def continue_line(kept: list[str], run_dir: Path, output_dir: Path) -> str:
    """The command that resumes the run from its newest checkpoint (``kept`` overrides,
    ``trainer.resume_from_checkpoint=latest`` and its directory); a new run from that checkpoint's weights where it
    holds the model only (trainer.save_only_model: a resume would be refused); before one, the command that starts
    it again."""
    import shlex

    from asyncrl.trainer.checkpoint import checkpoint_step, holds_model_only, list_checkpoints, new_run_from

    checkpoints = list_checkpoints(output_dir)
    if not checkpoints:
        return f"before its first checkpoint: nothing to resume; start again with: asyncrl train {shlex.join(kept)}"
    newest = checkpoints[-1]
    saved = f"{newest.name} (step {checkpoint_step(newest)})"
    if holds_model_only(newest):
        return (f"{saved} holds the model only (trainer.save_only_model), which cannot resume; go on in a new run "
                f"from its weights: asyncrl train {shlex.join(kept)} {new_run_from(newest)}")  # fmt: skip
    resume = [*kept, "trainer.resume_from_checkpoint=latest", f"hydra.run.dir={run_dir}"]
    return f"resume from {saved} with: asyncrl train {' '.join(shlex.quote(o) for o in resume)}"


def run_job(plan: RunPlan, run_dir: Path, cfg: DictConfig) -> None:
    """One training job in ``run_dir`` as ``plan`` (composed from ``cfg``) says: the server is stopped however the
    job ends."""
    config = plan.config
    from asyncrl.trainer.loop import run_training
    from asyncrl.trainer.setup import prepare

    check_startup(config, [run_dir])
    if config.server.launch:  # before plan.json: the trainer ranks read the weights directory there
        claim_server_access(plan)
    terminate_on_sigterm()
    with pushing(config, run_dir):  # its Hub repository first: a token that cannot write there refuses the run
        prepared = prepare(plan)  # data, picklability: fail before the server starts
        write_provenance(plan, cfg, run_dir)  # a run refused until here leaves the directory as it was
        log.info(dtype_line(plan))
        warn_cpu_oversubscribed(plan)
        if config.server.launch and plan.server_backend == "vllm":
            from asyncrl.serving.vllm import warn_uncompiled_imports

            warn_uncompiled_imports()
        with start_server(plan, run_dir, wait=False) as server:  # it boots while the trainer builds its model
            if plan.world_size > 1:
                from asyncrl.trainer.launcher import run_ranks

                run_ranks(run_dir, server)  # the ranks read run_dir/plan.json; rank 0 prepares again and waits
                # for the server's health after building its shard of the model
            else:
                from asyncrl.trainer.ranks import Ranks

                with Ranks.alone() as ranks:
                    run_training(config, run_dir, server, prepared, ranks)
    if config.logging.report:
        from asyncrl.report import write_report

        print(f"report: {write_report(run_dir)}", flush=True)


def dtype_line(plan: RunPlan) -> str:
    """Which dtype each side uses, for the startup log: a gap between the sampler's and the trainer's
    log-probabilities starts there."""
    from asyncrl.trainer.model import mixed_precision_dtype

    config = plan.config
    half = mixed_precision_dtype(config)
    mixed = f", computes in {str(half).removeprefix('torch.')} mixed precision" if half is not None else ""
    why = "server.dtype" if config.server.dtype is not None else "default: 16 bits on a GPU, model.dtype on a CPU"
    return (
        f"dtypes: the trainer keeps {config.model.dtype} weights (model.dtype){mixed}; the {plan.server_backend} "
        f"server computes in {plan.serving_dtype} ({why}) and weight syncs send that"
    )


def check_startup(config: Config, job_dirs: list[Path]) -> None:
    """The checks before a job writes anything, also made before Hydra starts it (asyncrl/cli.py): the resume, or
    ``job_dirs`` hold no earlier run; the model directory; the server's port."""
    from asyncrl.trainer.setup import check_model_path

    for job_dir in job_dirs:
        _check_resume(config, job_dir)
    check_model_path(config)
    check_port(config)


def write_provenance(plan: RunPlan, cfg: DictConfig, run_dir: Path) -> None:
    """plan.json (the plan every child process reads), config.yaml (its resolved config, for people) and Hydra's
    .hydra/ (the composed config, Hydra's own and the overrides), written once the job's checks passed
    (conf/config.yaml sets hydra.output_subdir=null)."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    hydra = HydraConfig.get()
    provenance = run_dir / ".hydra"
    provenance.mkdir(parents=True, exist_ok=True)
    (provenance / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    (provenance / "hydra.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create({"hydra": hydra})))
    (provenance / "overrides.yaml").write_text(OmegaConf.to_yaml(hydra.overrides.task))
    (run_dir / "config.yaml").write_text(to_yaml(plan.config))
    write_plan(plan, run_dir)


def warn_cpu_oversubscribed(plan: RunPlan) -> None:
    """One warning when a CPU run starts more trainer ranks than this machine has cores."""
    import torch

    from asyncrl.trainer.model import available_cores, oversubscribed_cores

    warning = None if torch.cuda.is_available() else oversubscribed_cores(plan.ranks_per_node, available_cores())
    if warning:
        log.warning(warning)


def check_port(config: Config) -> None:
    """The port of a server to launch is free: otherwise the new server fails to bind, and the run would talk to
    whatever listens there."""
    from asyncrl.serving.command import replica_port
    from asyncrl.serving.process import port_in_use, port_is_free

    sv = config.server
    for replica in range(sv.replicas if sv.launch else 0):
        port = replica_port(config, replica)
        if not port_is_free(sv.host, port):
            which = f"server.port={sv.port}" if replica == 0 else f"server.port={sv.port} + replica {replica}"
            raise ConfigError(
                f"{which}: {port_in_use(sv.host, port)}; choose a free one with "
                "server.port=N, or attach to it with server.launch=false"
            )


def _check_resume(config: Config, run_dir: Path) -> None:
    """Before anything loads: the checkpoint is whole and not under later checkpoints of another history; without
    resume, the directories hold no earlier run."""
    from asyncrl.trainer.checkpoint import (
        check_checkpoint,
        check_no_later_checkpoints,
        check_vision_tower,
        resolve_checkpoint,
    )

    spec = config.trainer.resume_from_checkpoint
    output_dir = Path(config.trainer.output_dir or run_dir)
    if not spec:
        _check_fresh(run_dir, output_dir)
        return
    resume = resolve_checkpoint(spec, output_dir)
    check_checkpoint(resume)
    check_vision_tower(config, resume)
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


def claim_server_access(plan: RunPlan) -> None:
    """The token and weights directory of a server this run launches. The token is $ASYNCRL_SERVER_TOKEN, else a
    fresh one put there: the environment (not argv, which ``ps`` shows every user) carries it to the server and to
    every process of the run, whose clients send it. The private weights directory the plan chose (server.weights_dir
    unset: plan/assemble.py::job_dirs) is created here, readable by this user only, and removed at exit; one left by
    a launcher killed outright (no exit handler ran) is removed by the next."""
    from asyncrl.client import ensure_token

    ensure_token()
    private = plan.private_weights_dir
    if private is not None and not private.is_dir():
        private.parent.mkdir(parents=True, exist_ok=True)
        remove_orphaned_transfer_dirs(private.parent)
        private.mkdir(mode=0o700)
        atexit.register(shutil.rmtree, private, ignore_errors=True)


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


def launch_command(plan: RunPlan, replica: int = 0) -> ServerCommand:
    """The command of server ``replica`` this run launches, as its plan holds it (plan/assemble.py::commanded, or
    ::measured for a vLLM that waited for the warm-up), once its token and weights directory are claimed (one
    directory for every replica: a weight file is written once and each loads it). vLLM reads the token as its
    --api-key from VLLM_API_KEY (serving/vllm.py says what that guards)."""
    from asyncrl.client import TOKEN_ENV

    if plan.server_commands is None:
        raise ValueError("a launched server's command is its plan's: plan/assemble.py::plan_run decides it for a job")
    claim_server_access(plan)
    command = plan.server_commands[replica]
    if command.backend == "vllm":
        os.environ["VLLM_API_KEY"] = os.environ[TOKEN_ENV]
    return command


def start_server(plan: RunPlan, run_dir: Path, wait: bool = True) -> ServerGroup:
    """A context manager: the supervised servers (server.replicas of them) as the plan's commands say, or handles on
    running ones when server.launch=false. ``wait=False``: launched servers are only started on entry; ``ready()``
    waits for them. A vLLM that shares the trainer's GPU starts when the trainer has measured its footprint in a
    warm-up step (trainer/memory.py): its share is a launch flag, and its command the plan's measured stage
    (``after_warm_up``)."""
    from asyncrl.serving.command import base_url, base_urls
    from asyncrl.serving.group import ServerGroup
    from asyncrl.serving.handle import AttachedServer, DeferredServer

    config = plan.config
    if not config.server.launch:
        return ServerGroup([AttachedServer(url, timeout_s=config.server.timeout) for url in base_urls(config)], wait)
    deferred = False
    if plan.gpu_split is not None:  # a launched vLLM, on the GPUs the plan placed it
        from asyncrl.plan.decide import measured_split_pending

        deferred = measured_split_pending(plan)
        cache = os.environ.get("VLLM_CACHE_ROOT") or "~/.cache/vllm"
        log.info("vLLM keeps its compile cache in %s across runs (VLLM_CACHE_ROOT): the first start of a shape "
                 "compiles, later ones load it", cache)  # fmt: skip
        if deferred:
            log.info("vLLM starts once the trainer knows its memory: measured by a warm-up step, or the room it holds "
                     "before a first warm-up that autotunes")  # fmt: skip
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(plan.gpu_split.trainer)  # the servers' are in their env
    (run_dir / "commands").mkdir(exist_ok=True)
    replicas = range(config.server.replicas)
    if not deferred:
        return ServerGroup([launched_server(plan, run_dir, replica) for replica in replicas], wait)
    launch = after_warm_up(plan, run_dir)
    return ServerGroup([DeferredServer(partial(launch, replica), base_url(config, replica)) for replica in replicas],
                       wait)  # fmt: skip


def launched_server(plan: RunPlan, run_dir: Path, replica: int) -> LaunchedServer:
    """Server ``replica`` started (not waited for) as its plan's command says, which commands/<name>.sh holds to
    rerun it alone."""
    from asyncrl.serving.command import base_url
    from asyncrl.serving.handle import LaunchedServer

    config = plan.config
    name = "server" if config.server.replicas == 1 else f"server_{replica}"
    command = launch_command(plan, replica)
    (run_dir / "commands" / f"{name}.sh").write_text(shell_line(command.argv, command.env))
    log_path = run_dir / "logs" / f"{name}.log"
    return LaunchedServer(command, base_url(config, replica), log_path, config.server.timeout, wait=False)


def after_warm_up(plan: RunPlan, run_dir: Path) -> Callable[[int, TrainerMemory | None], LaunchedServer]:
    """How the servers that wait for the trainer's warm-up start: the first adds the plan's measured stage on the
    footprint the warm-up measured (plan/assemble.py::measured) and writes it to plan.json, and each launches its
    command from it. A restart's plan has the stage already, and launches its commands as they are."""
    from asyncrl.plan.assemble import measured

    staged = plan

    def launch(replica: int, memory: TrainerMemory | None) -> LaunchedServer:
        nonlocal staged
        if staged.server_commands is None:
            staged = measured(staged, memory)
            write_plan(staged, run_dir)
        return launched_server(staged, run_dir, replica)

    return launch


def serve_overrides(args: list[str]) -> list[str]:
    """`asyncrl serve`'s arguments as overrides. A first argument that is no override is a directory: a run's (its
    final model, else its newest checkpoint, composed with the run's own overrides) or a model's."""
    if not args or "=" in args[0] or args[0].startswith("~"):
        return args
    import yaml

    from asyncrl.export import ExportError, resolve_source
    from asyncrl.lora import is_adapter_dir

    source = Path(args[0])
    try:
        model = resolve_source(source)
    except ExportError as exc:
        raise ConfigError(f"asyncrl serve {source}: {exc}") from exc
    if is_adapter_dir(model):
        raise ConfigError(f"{model} is a LoRA adapter: merge it with `asyncrl export {source} OUT`, then serve OUT")
    recorded = source / ".hydra" / "overrides.yaml"
    earlier = (yaml.safe_load(recorded.read_text()) or []) if recorded.is_file() else []
    kept = other_overrides(earlier, ("hydra.", "trainer.resume_from_checkpoint", "trainer.output_dir"))
    return [*kept, *args[1:], f"model.name_or_path={model}"]


def other_overrides(overrides: list[str], keys: tuple[str, ...]) -> list[str]:
    """``overrides`` less those that set, add or delete a key starting with one of ``keys``."""
    return [o for o in overrides if not o.lstrip("+~").startswith(keys)]


def check_serve(config: Config) -> None:
    """`asyncrl serve`'s configuration, before anything starts: one server, a model that loads, a free port."""
    from asyncrl.trainer.setup import check_model_path

    if config.server.replicas > 1:
        raise ConfigError(
            f"server.replicas={config.server.replicas}: asyncrl serve runs one server; start one per port "
            "(server.port=P) and attach the run to them with server.launch=false server.base_urls=[...]"
        )
    check_model_path(config)
    check_port(config)


SERVE_DIR = "runs/serve"
"""`asyncrl serve`'s directory (its server log, its private weights directory's fallback) without trainer.output_dir."""


def serve_plan(args: list[str]) -> RunPlan:
    """`asyncrl serve ARGS`'s plan (``serve_overrides``), its directories and command decided as a training job's
    are; a vLLM that a job would start after its trainer's warm-up has no trainer here to wait for, and takes its
    share as a printed command does (plan/assemble.py::measured, on no figure of its own)."""
    from asyncrl.config.compose import compose
    from asyncrl.plan.assemble import measured

    composed = compose(serve_overrides(args))
    plan = plan_run(composed, Path(composed.trainer.output_dir or SERVE_DIR))
    return plan if plan.server_commands is not None else measured(plan, None)


def serve_forever(plan: RunPlan) -> None:
    """`asyncrl serve`: the server in the foreground until Ctrl-C."""
    from asyncrl.client import TOKEN_ENV
    from asyncrl.serving.command import base_url, served_model_name
    from asyncrl.serving.handle import LaunchedServer

    config = plan.config
    run_dir = Path(config.trainer.output_dir or SERVE_DIR)
    keep_triton_autotuning()
    command = launch_command(plan)
    print(shell_line(command.argv, command.env), flush=True)
    terminate_on_sigterm()
    log_path = run_dir / "logs" / "server.log"
    try:  # Ctrl-C during startup stops the server too (the context manager's exit runs either way)
        with LaunchedServer(command, base_url(config), log_path, config.server.timeout) as server:
            served = f"{config.model.name_or_path} as {served_model_name(config)!r}"
            print(f"serving {served} at {server.base_url} (log: {server.log_path})", flush=True)
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


def shell_line(argv: list[str], env: dict[str, str]) -> str:
    import shlex

    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    return (prefix + " " if prefix else "") + " ".join(shlex.quote(a) for a in argv) + "\n"
