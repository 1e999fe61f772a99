"""The trainer's ranks: of several nodes, the leader's (the node of `asyncrl train`) first rank becomes trainer rank 0,
whatever rank torchrun's rendezvous gave its node, and each node's ranks stay together; object collectives take no
GPU memory."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from asyncrl.trainer.ranks import backends, leader_first


def test_the_leader_becomes_rank_zero_and_nodes_stay_contiguous():
    store = dist.HashStore()
    # two nodes of two ranks; the rendezvous put the leader's node second (launcher ranks 2 and 3)
    assert leader_first(store, 2, 4, leader=True) == 0
    assert [leader_first(store, rank, 4, leader=False) for rank in (3, 0, 1)] == [1, 2, 3]


def test_a_job_without_a_leader_says_which_command_is_missing():
    store = dist.HashStore()
    store.set_timeout(timedelta(milliseconds=1))
    with pytest.raises(RuntimeError, match=r"trainer rank 1: no node of this torchrun job is `asyncrl train`'s"):
        leader_first(store, 1, 2, leader=False)


def test_object_collectives_on_a_gpu_go_over_gloo_and_take_no_gpu_memory():
    """torch picks the CPU backend of a group for object collectives where it has one: a GPU group must carry
    gloo for the CPU, or a checkpoint's save plans travel as CUDA tensors through NCCL."""
    from torch.distributed.distributed_c10d import BackendConfig

    gpu = BackendConfig(backends(torch.device("cuda", 0))).get_device_backend_map()
    assert gpu == {"cuda": "nccl", "cpu": "gloo"}
    assert BackendConfig(backends(torch.device("cpu"))).get_device_backend_map()["cpu"] == "gloo"
