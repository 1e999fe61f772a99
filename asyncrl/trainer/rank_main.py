"""``python -m asyncrl.trainer.rank_main RUN_DIR``: one trainer rank of a multi-rank run, from the run directory's
plan.json (the launcher's plan: a rank plans nothing), started by torch's launcher (asyncrl/trainer/launcher.py on
the CLI's node, torchrun on the others; trainer/distributed.py says what each rank does)."""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
from pathlib import Path

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import get_error_handler, record

from asyncrl.config.errors import ConfigError
from asyncrl.logs import console_handler
from asyncrl.parent import exit_with_parent
from asyncrl.plan_file import read_plan
from asyncrl.run_plan import RunPlan
from asyncrl.serving.group import ServerGroup
from asyncrl.serving.handle import AttachedServer
from asyncrl.trainer.distributed import ORPHAN_GRACE_S, Follower, leave
from asyncrl.trainer.exits import EXPECTED_ERRORS, terminate_on_sigterm
from asyncrl.trainer.loop import run_training
from asyncrl.trainer.ranks import SERVER_URL_ENV, Ranks
from asyncrl.trainer.setup import prepare


@record  # an unexpected exception reaches the rank's error file too, where its launcher reads it
def main(run_dir: Path) -> int:
    """One rank of a multi-rank run, from the run directory's plan.json."""
    plan = read_plan(run_dir)
    terminate_on_sigterm()
    faulthandler.enable()  # a rank that crashes leaves its Python stack in its log
    agent = os.getppid()  # a rank waiting inside a collective never runs its SIGTERM handler: leave after a grace
    exit_with_parent(agent, grace_s=ORPHAN_GRACE_S, message=f"trainer rank: its launcher (pid {agent}) is gone")
    ranks = Ranks.from_env()
    if ranks.rank == 0:  # its progress lines ("resumed from ...", checkpoints) reach the terminal as in one process
        logging.basicConfig(level=logging.INFO, handlers=[console_handler()])  # libraries' records from WARNING
    try:
        check_world(plan, ranks)
        if ranks.rank == 0:
            run_rank_zero(plan, run_dir, ranks)
        else:
            Follower(plan, run_dir, ranks).serve()
        # Tear the process group down together: a rank that destroys it while another still talks to the
        # store can abort in gloo's threads ("terminate called without an active exception").
        dist.barrier()
    except EXPECTED_ERRORS as exc:
        print(f"error ({type(exc).__name__}): {exc}", file=sys.stderr)
        get_error_handler().record_exception(exc)
        return 1
    except KeyboardInterrupt:  # the CLI stops the ranks with SIGTERM and says why itself
        return 130
    finally:
        dist.destroy_process_group()
    return 0


def check_world(plan: RunPlan, ranks: Ranks) -> None:
    """Every node started as many ranks as the plan says: a node with another count would shard differently."""
    if ranks.world != plan.world_size:
        nodes, per_node = plan.config.trainer.nnodes, plan.ranks_per_node
        raise ConfigError(
            f"trainer rank {ranks.rank}: the launchers started {ranks.world} ranks but the run has "
            f"{plan.world_size} (trainer.nnodes={nodes}, {per_node} per node): start every other node with "
            f"torchrun --nnodes {nodes} --nproc-per-node {per_node}"
        )


def run_rank_zero(plan: RunPlan, run_dir: Path, ranks: Ranks) -> None:
    """Rank 0 is the trainer of a single-process run, attached to the servers the CLI started (their URLs in
    SERVER_URL_ENV, comma-separated)."""
    urls = os.environ[SERVER_URL_ENV].split(",")
    server = ServerGroup([AttachedServer(url, timeout_s=plan.config.server.timeout, booting=True) for url in urls])
    run_training(plan.config, run_dir, server, prepare(plan), ranks=ranks)


if __name__ == "__main__":
    leave(main(Path(sys.argv[1])))
