"""Joining the job: the process group of this rank (NCCL on GPUs, gloo on CPUs), from the
environment torchrun or `megatrain run` set.
"""

import datetime
import os

import torch
import torch.distributed as dist


def init_distributed(timeout: float | None = None) -> tuple[torch.device, bool]:
    """Join the job described by the environment (RANK, WORLD_SIZE, MASTER_ADDR, ...).

    Returns (this rank's device, whether this call created the process group).
    NCCL on GPUs, gloo on CPUs; `timeout`: seconds a collective waits (None: torch's).
    """
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank % torch.cuda.device_count()) if cuda else None
    if cuda:
        torch.cuda.set_device(device)
    created = False
    if not dist.is_initialized():
        wait = {"timeout": datetime.timedelta(seconds=timeout)} if timeout else {}
        dist.init_process_group(
            "nccl" if cuda else "gloo", device_id=device, **_attempt_store(wait), **wait
        )
        created = True
    return device or torch.device("cpu"), created


def _attempt_store(wait: dict) -> dict:
    """The store this attempt's process group meets in, when torch's elastic agent restarted
    the workers: the agent's store outlives an attempt, and the keys the last attempt's
    ranks left there (their addresses) would send this one's connections to dead ports
    (torch issue 135712).  Each attempt gets its own key prefix; first attempts and other
    launchers use torch's own env:// store."""
    env = os.environ
    attempt = int(env.get("TORCHELASTIC_RESTART_COUNT") or 0)
    if not attempt or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    store = dist.TCPStore(
        env["MASTER_ADDR"], int(env["MASTER_PORT"]), int(env["WORLD_SIZE"]), is_master=False,
        **wait,
    )  # fmt: skip
    return {
        "store": dist.PrefixStore(f"megatrain/attempt-{attempt}", store),
        "rank": int(env["RANK"]),
        "world_size": int(env["WORLD_SIZE"]),
    }
