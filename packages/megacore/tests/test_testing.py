"""The distributed test harness: results come back, and failures and hangs surface as errors."""

import multiprocessing as mp
import os
import time

import pytest
import torch
import torch.distributed as dist

from megacore.testing import DistributedTestError, run_distributed


def _all_reduce_rank_ids(scale):
    rank = dist.get_rank()
    t = torch.tensor([scale * (rank + 1)])
    dist.all_reduce(t)
    return {
        "rank": rank,
        "world": dist.get_world_size(),
        "env_rank": int(os.environ["RANK"]),
        "backend": dist.get_backend(),
        "sum": t.item(),
    }


def _rank_two_raises():
    if dist.get_rank() == 2:
        raise ValueError("rank two refuses")
    dist.barrier()  # the other ranks wait here for rank 2, as in a real collective


def _rank_one_hangs():
    if dist.get_rank() == 1:
        time.sleep(3600)
    dist.barrier()


def _rank_one_dies():
    if dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()


def test_all_reduce_on_four_ranks():
    results = run_distributed(_all_reduce_rank_ids, world_size=4, args=(2.0,))
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    assert [r["env_rank"] for r in results] == [0, 1, 2, 3]
    assert all(r["world"] == 4 and r["backend"] == "gloo" for r in results)
    assert [r["sum"] for r in results] == [2.0 * (1 + 2 + 3 + 4)] * 4
    assert mp.active_children() == []


def test_raising_rank_brings_its_traceback():
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_rank_two_raises, world_size=4, timeout=120)
    message = str(info.value)
    first_report = message.split("Then, often as a consequence")[0]
    assert "failed on rank 2 of 4" in first_report
    assert 'raise ValueError("rank two refuses")' in first_report  # the traceback's source line
    assert "ValueError: rank two refuses" in first_report
    # Ranks 0, 1 and 3 either failed in the barrier afterwards or were stopped; none finished.
    assert "ranks finished" not in message
    # The waiting ranks are stopped at once, not left to the 120 s collective timeout.
    assert time.monotonic() - start < 60
    assert mp.active_children() == []


def test_hanging_rank_fails_at_the_timeout_with_its_stack():
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_rank_one_hangs, world_size=2, timeout=15)
    message = str(info.value)
    assert "timed out after 15 s on 2 ranks" in message
    rank1 = message.split("--- rank 1 ---")[1]
    assert "_rank_one_hangs" in rank1 and "test_testing.py" in rank1
    rank0 = message.split("--- rank 0 ---")[1].split("--- rank 1 ---")[0]
    assert "barrier" in rank0
    assert mp.active_children() == []


def test_rank_that_dies_without_a_traceback_is_reported():
    with pytest.raises(DistributedTestError, match="rank 1 of 2") as info:
        run_distributed(_rank_one_dies, world_size=2, timeout=120)
    assert "exited with code 3 before reporting" in str(info.value)


def test_function_that_cannot_be_pickled_is_refused_before_spawning():
    with pytest.raises(TypeError, match="top level of a module"):
        run_distributed(lambda: None, world_size=2)
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        run_distributed(_all_reduce_rank_ids, world_size=0)
