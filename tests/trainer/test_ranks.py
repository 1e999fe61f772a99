"""Ranks of several nodes: the leader's (the node of `asyncrl train`) first rank becomes trainer rank 0, whatever
rank torchrun's rendezvous gave its node, and each node's ranks stay together."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from asyncrl.trainer.ranks import leader_first


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
