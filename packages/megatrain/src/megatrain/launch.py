"""Starting the worker processes: torch.distributed's elastic launcher, or the job we are in.

- Under torchrun (or any launcher that sets RANK and WORLD_SIZE) each process
  is already a worker and joins the job from the environment.
- Under Slurm with one task per GPU (`srun megatrain run ...`), SLURM_PROCID,
  SLURM_NTASKS and SLURM_LOCALID become RANK, WORLD_SIZE and LOCAL_RANK;
  MASTER_ADDR must name the first node (see scripts/slurm/).
- Otherwise `megatrain run` is the launcher: torch's elastic agent starts
  `nproc_per_node` workers here, and with --nnodes > 1 it meets the agents of
  the other nodes at --master-addr:--master-port (static rendezvous by --node-rank).
"""

import os
import uuid
from collections.abc import Callable

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch


class LaunchError(RuntimeError):
    """The workers failed; the message holds the first failure's error."""


def in_launched_job() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def adopt_slurm_environment() -> bool:
    """Translate one-task-per-GPU Slurm variables to torch's; False when not under such a job."""
    env = os.environ
    if in_launched_job() or "SLURM_PROCID" not in env or int(env.get("SLURM_NTASKS", "1")) < 2:
        return False
    if "MASTER_ADDR" not in env:
        raise LaunchError(
            "running under Slurm with SLURM_NTASKS="
            f"{env['SLURM_NTASKS']} tasks, but MASTER_ADDR is not set; export it in the batch "
            "script, e.g. MASTER_ADDR=$(scontrol show hostnames $SLURM_JOB_NODELIST | head -n 1)"
        )
    env["RANK"] = env["SLURM_PROCID"]
    env["WORLD_SIZE"] = env["SLURM_NTASKS"]
    env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
    env["LOCAL_WORLD_SIZE"] = env.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0]
    env.setdefault("MASTER_PORT", "29500")
    return True


def launch(
    entrypoint: Callable,
    args: tuple,
    *,
    nproc_per_node: int,
    nnodes: int = 1,
    node_rank: int = 0,
    master_addr: str = "127.0.0.1",
    master_port: int = 29500,
    max_restarts: int = 0,
) -> dict:
    """Run `entrypoint(*args)` in nproc_per_node workers on this node; {global rank: result}."""
    if nnodes == 1:  # as `torchrun --standalone`: a rendezvous on a free local port
        rdzv = {"rdzv_backend": "c10d", "rdzv_endpoint": "127.0.0.1:0", "rdzv_configs": {}}
    else:
        rdzv = {
            "rdzv_backend": "static",
            "rdzv_endpoint": f"{master_addr}:{master_port}",
            "rdzv_configs": {"rank": node_rank, "timeout": 900},
        }
    config = LaunchConfig(
        min_nodes=nnodes,
        max_nodes=nnodes,
        nproc_per_node=nproc_per_node,
        run_id=os.environ.get("MEGATRAIN_RUN_ID", str(uuid.uuid4())),
        max_restarts=max_restarts,
        monitor_interval=0.5,
        start_method="spawn",
        **rdzv,
    )
    try:
        return elastic_launch(config, entrypoint)(*args)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        message = failure.message
        if isinstance(message, dict):
            message = message.get("message", message)
        raise LaunchError(f"worker rank {rank} failed: {message}") from e


def run_workers(entrypoint: Callable, args: tuple, nproc: int) -> dict:
    """`entrypoint(*args)` on `nproc` local workers; {rank: result}.

    For tools that are not training (generation, evaluation, conversion).  One
    worker runs in this process, in a one-rank process group of its own, which
    saves a process start; more go through `launch`.
    """
    if nproc > 1:
        return launch(entrypoint, args, nproc_per_node=nproc)
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    saved = {k: os.environ.get(k) for k in [*env, "MASTER_PORT"]}
    os.environ.update(env, MASTER_PORT=str(port))
    try:
        return {0: entrypoint(*args)}
    finally:
        from megacore import parallel_state

        parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
