"""Saving a run: written completely before `latest` moves.

A save goes to `.tmp-iter_N/`, is checked (every rank's files present, sizes
recorded in meta.json), renamed to `iter_N/`, and only then is `latest`
replaced (write to a temporary file, rename).  A process killed during a save
leaves the previous checkpoint and `latest` as they were.  Nothing is
unpickled: DCP reads tensors, RNG files load with `weights_only=True`.
"""

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from megacommon.files import atomic_write_json
from megacore import tensor_parallel as tp
from megatrain import __version__
from megatrain.checkpoint.dcp import (
    Pieces,
    flat_range_boxes,
    global_tensor,
    layout_of,
    module_of,
    named_buffers,
    named_params,
    own_storage,
    placed,
    root_cause,
    tp_mesh,
    tp_place,
    written_pieces,
)
from megatrain.checkpoint.files import (
    FORMAT_VERSION,
    LATEST,
    MODEL_FIELDS,
    OPTIMIZER_STATES,
    CheckpointError,
    iteration_dir,
)


def file_sizes(directory: Path) -> dict[str, int]:
    """Every file under `directory` (relative path -> bytes), as meta.json records them."""
    return {
        str(f.relative_to(directory)): f.stat().st_size
        for f in sorted(directory.rglob("*"))
        if f.is_file()
    }


def publish(tmp: Path, final: Path, meta: dict, before_latest=None) -> None:
    """The last step of every save: meta.json into the complete `tmp` directory, `tmp`
    renamed to `final`, and only then `latest` (a temporary file renamed) naming it.
    (`before_latest`: a test's fault hook, between the renames.)"""
    atomic_write_json(tmp / "meta.json", meta, sort_keys=False)
    # The same iteration saved again (a resume at N that saves at N): the old copy is moved
    # aside, not deleted, until the new one is in place, so a kill between the two renames
    # leaves `latest` naming a complete directory (`find_checkpoint` falls back to the old).
    old = final.parent / f".old-{final.name}"
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    if before_latest is not None:
        before_latest()
    latest_tmp = final.parent / f".{LATEST}.tmp"
    latest_tmp.write_text(final.name + "\n")
    os.replace(latest_tmp, final.parent / LATEST)
    shutil.rmtree(old, ignore_errors=True)


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state(), **tp.get_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _range_boxes(shard, flat: torch.Tensor, mesh: DeviceMesh) -> list:
    """A shard's flat tensor (its elements [start, end) of the TP-local parameter) as DCP
    chunks: (offsets in the global tensor, a box of `flat`, sharing its memory; an expert
    weight's box split at its regions, `placed`, a strided piece a view too: `written_pieces`)."""
    boxes = flat_range_boxes(tuple(shard.param.shape), shard.start, shard.end)
    return [
        piece
        for a, b, offsets, sizes in boxes
        for piece in written_pieces(
            placed(shard.param, mesh, offsets, flat[a - shard.start : b - shard.start].view(sizes))
        )
    ]


def _optimizer_pieces(run, params: dict, mesh: DeviceMesh) -> dict[str, Pieces]:
    """This rank's optimizer state as DCP should see it: "<name>/<state>" at the parameter's
    global shape, holding the boxes of this rank's ranges (views of the optimizer's own
    tensors: nothing is copied or gathered here)."""
    names = {p: n for n, p in params.items()}  # without the last stage's tied embeddings
    pieces: dict[str, list] = {}
    shapes = {}
    for shard, state in run.optimizer.shard_state():
        name = names.get(shard.param)
        if name is None or shard.start == shard.end:  # FSDP: a rank may hold no rows
            continue
        for key in OPTIMIZER_STATES:
            shapes[f"{name}/{key}"] = tp_place(shard.param, mesh)[0]
            pieces.setdefault(f"{name}/{key}", []).extend(_range_boxes(shard, state[key], mesh))
    return {
        key: Pieces(shapes[key], torch.float32, run.device, chunks)
        for key, chunks in pieces.items()
    }


def _weights(run, params: dict, mesh: DeviceMesh) -> dict:
    """The weights as DCP should see them, at their global shapes in the run's dtype: a TP
    shard as a DTensor over TP, a replicated parameter as it is; a parameter FSDP2 shards
    (a DTensor over DP, `data_parallel_sharding = "full"`) as the boxes of this rank's rows,
    its fp32 master (in the run's dtype: a copy of the rank's rows only, when 16-bit); the
    `STATE_BUFFERS` (expert biases) as they are.  The same tensors every layout writes:
    nothing is gathered."""
    names = {p: n for n, p in params.items()}
    weights = {
        n: global_tensor(own_storage(p.detach()), p, mesh, writing=True)
        for n, p in params.items()
        if not isinstance(p, DTensor)
    }
    # The expert biases (fp32, the same on every rank holding the layer: written once).
    weights.update(named_buffers(run.chunks))
    for shard in run.optimizer.shards:
        name = names.get(shard.param)
        if name is None or not isinstance(shard.param, DTensor) or shard.start == shard.end:
            continue
        flat = shard.master.detach().to(run.dtype)
        chunks = _range_boxes(shard, flat, mesh)
        weights[name] = Pieces(tp_place(shard.param, mesh)[0], run.dtype, run.device, chunks)
    return weights


@dataclass
class Snapshot:
    """What one rank saves of a run at an iteration, as DCP and torch.save take it: the
    weights and the optimizer state (views of the run's own tensors, or their host copies for
    a background write), the generators' states and, on rank 0, meta.json without its file
    list (`files` is added once every file is written)."""

    iteration: int
    model: dict
    optimizer: dict
    rng: dict
    meta: dict | None
    tokenizer: Path | None


def _reshard(chunks) -> None:
    """FSDP2 keeps the parameters it does not free after a forward (a chunk's own, gathered
    from its forward to its backward) unsharded until the backward; an evaluation runs
    forwards only, and leaves them so.  A save sees the sharded parameters the optimizer
    updates: reshard every fully sharded module first (nothing to do where it is)."""
    from torch.distributed.fsdp import FSDPModule

    for chunk in chunks:
        for module in module_of(chunk).modules():
            if isinstance(module, FSDPModule):
                module.reshard()


def snapshot(run) -> Snapshot:
    """This rank's state at `run.iteration`, nothing copied or gathered."""
    # Under overlap_param_gather the last step's all-gathers may still be filling the weights.
    run.optimizer.finish_param_sync()
    _reshard(run.chunks)
    mesh = tp_mesh(run.device)
    params = named_params(run.chunks)
    meta = tokenizer = None
    if dist.get_rank() == 0:
        # The corpus's (a blend's first: they share it), or where fine-tuning points.
        source = run.config.data.corpus or run.train_data.corpus.path
        tokenizer = Path(source) / "tokenizer.json"
        meta = {
            "format_version": FORMAT_VERSION,
            "megatrain_version": __version__,  # named when another megatrain cannot read it
            "iteration": run.iteration,
            "model": {k: getattr(run.model_config, k) for k in MODEL_FIELDS},
            "padded_vocab_size": run.model_config.vocab_size,
            "vocab_size": run.train_data.corpus.vocab_size,
            "tokenizer": run.train_data.corpus.manifest.get("tokenizer"),
            "layout": layout_of(run),
            "config": run.config.to_dict(),
            # A round trip through JSON: the values of this iteration, not the data loader's
            # live objects, which go on while a background write runs.
            "data": json.loads(json.dumps(run.train_data.state_dict())),
            "optimizer": {
                "adam_step": run.optimizer.adam_step(),
                "grad_scaler": (
                    {k: float(v) for k, v in run.optimizer.grad_scaler.state_dict().items()}
                    if run.optimizer.grad_scaler
                    else None
                ),
                "num_skipped_steps": run.optimizer.num_skipped_steps,
            },
        }
    return Snapshot(
        run.iteration,
        _weights(run, params, mesh),
        _optimizer_pieces(run, params, mesh),
        _rng_state(),
        meta,
        tokenizer,
    )


def tmp_dir(ckpt: Path, iteration: int) -> Path:
    return Path(ckpt) / f".tmp-{iteration_dir(ckpt, iteration).name}"


def prepare(tmp: Path) -> None:
    """Rank 0, before any rank writes: an empty `tmp` (a killed save may have left one)."""
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "rng").mkdir(parents=True)


def write_model(snap: Snapshot, tmp: Path, group=None, after=None) -> None:
    """This rank's weights into `tmp` (DCP's collectives over `group`: every rank calls it);
    `after` runs once they are written (a test's fault hook)."""
    dcp.save(snap.model, checkpoint_id=tmp / "model", process_group=group)
    if after is not None:
        after()


def write_optimizer(snap: Snapshot, tmp: Path, group=None) -> None:
    """This rank's optimizer state and generators into `tmp` (every rank calls it)."""
    dcp.save(snap.optimizer, checkpoint_id=tmp / "optimizer", process_group=group)
    torch.save(snap.rng, tmp / "rng" / f"rank-{dist.get_rank():05d}.pt")


def complete(
    snap: Snapshot, ckpt: Path, world_size: int, keep: int = 0, before_latest=None
) -> Path:
    """Rank 0, once every rank's files are in `tmp`: the tokenizer copied, every file checked
    and listed in meta.json, `publish`ed, old iterations beyond `keep` removed."""
    tmp, final = tmp_dir(ckpt, snap.iteration), iteration_dir(ckpt, snap.iteration)
    if snap.tokenizer is not None and snap.tokenizer.is_file():
        shutil.copyfile(snap.tokenizer, tmp / "tokenizer.json")
    files = file_sizes(tmp)
    rng_files = [f for f in files if f.startswith("rng/")]
    if len(rng_files) != world_size:
        raise RuntimeError(f"checkpoint {tmp}: {len(rng_files)} RNG files for {world_size} ranks")
    publish(tmp, final, {**snap.meta, "files": files}, before_latest)
    if keep > 0:
        for old in sorted(ckpt.glob("iter_*"))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def save_failed(iteration: int, ckpt: Path, e: BaseException, how: str = "") -> CheckpointError:
    """A full disk, a quota, a read-only or vanished directory: one line naming the path; `latest`
    still names the last complete checkpoint (it moves only in `publish`)."""
    return CheckpointError(
        f"saving iteration {iteration} to {tmp_dir(ckpt, iteration)}{how} failed: "
        f"{root_cause(e)}; the last complete checkpoint in {ckpt} is untouched (free space or "
        "fix the directory, then resume from it)"
    )


def save_checkpoint(run, ckpt: str | Path, keep: int = 0) -> Path:
    """Save `run` at its iteration under `ckpt` (every rank calls it); returns the directory.

    `keep` > 0 keeps only that many newest iterations.
    """
    ckpt = Path(ckpt)
    tmp = tmp_dir(ckpt, run.iteration)
    try:
        rank = dist.get_rank()
        if rank == 0:
            prepare(tmp)
        dist.barrier()
        snap = snapshot(run)
        write_model(snap, tmp)
        write_optimizer(snap, tmp)
        dist.barrier()
        if rank == 0:
            complete(snap, ckpt, dist.get_world_size(), keep)
    except (OSError, dcp.api.CheckpointException) as e:
        raise save_failed(run.iteration, ckpt, e) from e
    dist.barrier()
    return iteration_dir(ckpt, run.iteration)
