"""What `megatrain run` checks before it starts any worker, so that a bad config, corpus,
checkpoint or directory fails in one line and in seconds, not in every rank after torch has
started: the processes per node, GPUs enough for them, a run already finished, a writable
checkpoint and output directory, a corpus and checkpoint that match the config, and the
planner's memory estimate of the layout."""

import math
import os
import tempfile

from megatrain.checkpoint.files import CheckpointError, find_checkpoint, read_meta
from megatrain.config import Config, ConfigError
from megatrain.data.blend import open_run_blend


def default_nproc(config: Config, nnodes: int) -> int:
    """Processes on this node: the configured layout, else one per GPU, else the fewest that
    hold a replica of both layouts (tp x cp x pp, and etp x ep x pp with split experts)."""
    p = config.parallel
    if p.data_parallel_size:
        total = config.ranks_per_replica * p.data_parallel_size
        if total % nnodes:
            raise ConfigError(
                f"tp x cp x pp x dp = {total} processes do not split over --nnodes {nnodes}"
            )
        return total // nnodes
    import torch

    if torch.cuda.is_available():
        return torch.cuda.device_count()
    etp = p.expert_tensor_parallel_size or p.tensor_model_parallel_size
    experts = etp * p.expert_model_parallel_size * p.pipeline_model_parallel_size
    return math.lcm(config.ranks_per_replica, experts)


def check_gpus(nproc: int, gpus: int) -> None:
    """NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), after every worker has
    started: say so before launching."""
    if gpus and nproc > gpus:
        raise ConfigError(
            f"--nproc-per-node {nproc} exceeds the {gpus} GPU(s) of this node: NCCL needs one "
            f"GPU per rank (use more nodes, or CUDA_VISIBLE_DEVICES= to train on the CPU)"
        )


def finished_iteration(config: Config) -> int | None:
    """The iteration of --load's checkpoint when it has trained all of training.train_iters
    (known from its meta.json, before any worker or torch starts), else None."""
    if not config.checkpoint.load:
        return None
    try:
        iteration = read_meta(find_checkpoint(config.checkpoint.load))["iteration"]
    except CheckpointError:
        return None  # none yet (or a broken one, which loading will name)
    return iteration if iteration >= config.training.train_iters else None


def check_restartable(config: Config) -> None:
    """Restarted workers resume from the run's own last checkpoint (training.resume)."""
    if not config.checkpoint.save:
        raise ConfigError(
            "--max-restarts needs --save (or checkpoint.save): restarted workers resume from "
            "its last checkpoint; also set checkpoint.save_interval"
        )


def check_inputs(config: Config) -> None:
    """Refuse a missing or mismatched corpus (of a blend: any, or tokenizers that differ) or
    checkpoint here rather than in every worker."""
    for split in ("train", "valid"):
        open_run_blend(config, split)
    load, save = config.checkpoint.load, config.checkpoint.save
    if load and not (load == save and not os.path.exists(os.path.join(load, "latest"))):
        find_checkpoint(load)
    if config.checkpoint.load_hf:  # the model's files refused here, not in every worker
        from megatrain.hf.layout_load import check_hf_source

        check_hf_source(config)
    if save:
        check_writable(save, "checkpoint.save (--save)")
    check_writable(config.training.output_dir, "training.output_dir")


def check_writable(directory: str, what: str) -> None:
    """Write (and remove) a file there now, rather than lose the first interval's work at the
    first save: a read-only filesystem, a full disk or missing permissions show here."""
    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as e:
        raise ValueError(f"{what} {directory}: cannot write there ({e.strerror or e})") from None


def plan_warning(config: Config, world_size: int) -> str | None:
    """A warning (not a refusal: the estimate leaves out what it cannot know) when the
    planner's memory estimate of this layout exceeds 90% of this node's GPU; None without
    CUDA or when it fits."""
    import torch

    if not torch.cuda.is_available():
        return None
    from megatrain.plan.search import memory_warning

    vocab = config.model.vocab_size or open_run_blend(config, "train").first.vocab_size
    dp = world_size // config.ranks_per_replica
    props = torch.cuda.get_device_properties(0)
    # SDPA's fused kernels (flash, cuDNN, memory-efficient) on Ampere and newer: the
    # estimate then keeps no s x s scores, as gpus.toml's "flash" GPUs
    attention = "flash" if (props.major, props.minor) >= (8, 0) else "unfused"
    warning = memory_warning(config, dp, vocab, props.total_memory, attention)
    if not warning:
        return None
    return (
        f"{warning}; it may run out of memory (`megatrain plan --config ...` ranks the layouts "
        "that fit; --no-plan-check drops this warning)"
    )
