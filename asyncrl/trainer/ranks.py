"""The trainer's ranks: this process's place among them with the few collectives the trainer makes
(trainer/distributed.py drives them); how many a run has is its plan's (asyncrl/run_plan.py).

A run of one trainer process is a world of one: the same FSDP2 model, step and checkpoint as several ranks, over a
process group on an in-memory store (``Ranks.alone``). Its collectives return at once instead of pickling a
step's rows through a group of one.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# Followers wait in a collective while rank 0 waits for rollouts; a dead rank is the launcher's to catch.
COLLECTIVE_TIMEOUT = timedelta(hours=2)
SERVER_URL_ENV = "ASYNCRL_SERVER_URL"
"""The generation servers' URLs (comma-separated), set by `asyncrl train` for the ranks of its own node: the first
of them is trainer rank 0, which drives the servers (a node that torchrun started has none of it)."""
LEADER_KEY = "asyncrl/leader"
LEADER_TIMEOUT = timedelta(minutes=5)


def leader_first(store: dist.Store, rank: int, world: int, leader: bool) -> int:
    """This process's trainer rank: its launcher rank turned so that the leader (the first rank of the node of
    `asyncrl train`) is 0. torchrun's c10d rendezvous numbers the nodes in the order of their host names, so the
    leader's node need not come first; a turn by the leader's rank (a multiple of the ranks per node) keeps each
    node's ranks together."""
    if leader:
        store.set(LEADER_KEY, str(rank))
    try:
        first = int(store.get(LEADER_KEY))
    except dist.DistStoreError as exc:
        raise RuntimeError(
            f"trainer rank {rank}: no node of this torchrun job is `asyncrl train`'s within {LEADER_TIMEOUT}: "
            "start the first node with `asyncrl train trainer.nnodes=N trainer.rdzv_endpoint=HOST:PORT`"
        ) from exc
    return (rank - first) % world


def backends(device: torch.device) -> str:
    """The process group's backend per device type: NCCL moves GPU tensors, gloo everything on the CPU.

    Object collectives (a step's commands, torch.distributed.checkpoint's save and load plans) pick the CPU
    backend when the group has one, so they take no GPU memory: over NCCL they did, and a save at the end of a
    run whose server had taken the rest of the GPU failed in ``gather_object`` ("Failed to CUDA calloc async 24
    bytes", session 32's real-model row)."""
    return "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"


class Ranks:
    """This process's place among the trainer ranks and the few collectives the trainer makes."""

    def __init__(self, rank: int, world: int, device: torch.device) -> None:
        self.rank, self.world, self.device = rank, world, device

    @classmethod
    def from_env(cls) -> Ranks:
        """Join the process group: nccl on GPU (one device per local rank), gloo on CPU. Ranks of several nodes
        (torchrun's GROUP_WORLD_SIZE > 1) meet on the launcher's store and put the leader first."""
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", rank))
        if torch.cuda.is_available():
            torch.cuda.set_device(local)
        if int(os.environ.get("GROUP_WORLD_SIZE", "1")) == 1:
            return cls._join(rank, world)
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=LEADER_TIMEOUT
        )
        rank = leader_first(store, rank, world, leader=local == 0 and SERVER_URL_ENV in os.environ)
        store.set_timeout(COLLECTIVE_TIMEOUT)
        return cls._join(rank, world, dist.PrefixStore("asyncrl", store))

    @classmethod
    @contextlib.contextmanager
    def alone(cls) -> Iterator[Ranks]:
        """This process as a world of one, for as long as the block runs (the CLI's own trainer; a Hydra sweep
        runs one job after another in the same process)."""
        ranks = cls._join(0, 1, dist.HashStore())
        try:
            yield ranks
        finally:
            dist.destroy_process_group()

    @classmethod
    def _join(cls, rank: int, world: int, store: Any = None) -> Ranks:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        dist.init_process_group(backends(device), store=store, rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT)
        return cls(rank, world, device)

    def command(self, name: str, payloads: list[Any] | None = None) -> Any:
        """Rank 0: send ``name`` with payloads[r] to each rank r; returns rank 0's own payload."""
        if self.world == 1:
            return None if payloads is None else payloads[0]
        items = [(name, None if payloads is None else payloads[r]) for r in range(self.world)]
        received: list[Any] = [None]
        dist.scatter_object_list(received, items, src=0)
        return received[0][1]

    def receive(self) -> tuple[str, Any]:
        """A follower: the next command and this rank's payload."""
        received: list[Any] = [None]
        dist.scatter_object_list(received, None, src=0)
        return received[0]

    def announce(self, index: int = 0) -> int:
        """Rank 0 says which parameter to gather next (-1: done); every rank returns that index."""
        if self.world == 1:
            return index
        value = torch.tensor([index], dtype=torch.long, device=self.device)
        dist.broadcast(value, src=0)
        return int(value.item())

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` on rank 0 (an empty list on the others)."""
        if self.world == 1:
            return [obj]
        out: list[Any] | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0)
        return out or []
