"""Saving a run: written completely before `latest` moves.

A save goes to `.tmp-iter_N/`, is checked (every rank's files present, sizes
recorded in meta.json), renamed to `iter_N/`, and only then is `latest`
replaced (write to a temporary file, rename).  A process killed during a save
leaves the previous checkpoint and `latest` as they were.  Nothing is
unpickled: DCP reads tensors, RNG files load with `weights_only=True`.
"""

import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from megacommon.files import atomic_write_json
from megacore import tensor_parallel as tp
from megatrain.checkpoint.dcp import (
    Pieces,
    flat_range_boxes,
    global_tensor,
    layout_of,
    named_params,
    own_storage,
    root_cause,
    tp_mesh,
    tp_place,
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


def publish(tmp: Path, final: Path, meta: dict) -> None:
    """The last step of every save: meta.json into the complete `tmp` directory, `tmp`
    renamed to `final`, and only then `latest` (a temporary file renamed) naming it."""
    atomic_write_json(tmp / "meta.json", meta, sort_keys=False)
    # The same iteration saved again (a resume at N that saves at N): the old copy is moved
    # aside, not deleted, until the new one is in place, so a kill between the two renames
    # leaves `latest` naming a complete directory (`find_checkpoint` falls back to the old).
    old = final.parent / f".old-{final.name}"
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
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
    chunks: (offsets in the global tensor, a box of `flat`, sharing its memory)."""
    _, tp_offsets = tp_place(shard.param, mesh)
    boxes = flat_range_boxes(tuple(shard.param.shape), shard.start, shard.end)
    return [
        (
            [o + t for o, t in zip(offsets, tp_offsets, strict=True)],
            own_storage(flat[a - shard.start : b - shard.start].view(sizes)),
        )
        for a, b, offsets, sizes in boxes
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
    its fp32 master (in the run's dtype: a copy of the rank's rows only, when 16-bit).  The
    same tensors every layout writes: nothing is gathered."""
    names = {p: n for n, p in params.items()}
    weights = {
        n: global_tensor(own_storage(p.detach()), p, mesh)
        for n, p in params.items()
        if not isinstance(p, DTensor)
    }
    for shard in run.optimizer.shards:
        name = names.get(shard.param)
        if name is None or not isinstance(shard.param, DTensor) or shard.start == shard.end:
            continue
        flat = shard.master.detach().to(run.dtype)
        chunks = _range_boxes(shard, flat, mesh)
        weights[name] = Pieces(tp_place(shard.param, mesh)[0], run.dtype, run.device, chunks)
    return weights


def save_checkpoint(run, ckpt: str | Path, keep: int = 0) -> Path:
    """Save `run` at its iteration under `ckpt` (every rank calls it); returns the directory.

    `keep` > 0 keeps only that many newest iterations.
    """
    ckpt = Path(ckpt)
    final = iteration_dir(ckpt, run.iteration)
    tmp = ckpt / f".tmp-{final.name}"
    try:
        rank = dist.get_rank()
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # left by a save that was killed
            (tmp / "rng").mkdir(parents=True)
        dist.barrier()
        # Under overlap_param_gather the last step's all-gathers may still be filling the weights.
        run.optimizer.finish_param_sync()
        mesh = tp_mesh(run.device)
        params = named_params(run.chunks)
        dcp.save(_weights(run, params, mesh), checkpoint_id=tmp / "model")
        dcp.save(_optimizer_pieces(run, params, mesh), checkpoint_id=tmp / "optimizer")
        torch.save(_rng_state(), tmp / "rng" / f"rank-{rank:05d}.pt")
        dist.barrier()
        if rank == 0:
            # The corpus's (a blend's first: they share it), or where fine-tuning points.
            source = run.config.data.corpus or run.train_data.corpus.path
            corpus_tokenizer = Path(source) / "tokenizer.json"
            if corpus_tokenizer.is_file():
                shutil.copyfile(corpus_tokenizer, tmp / "tokenizer.json")
            files = file_sizes(tmp)
            rng_files = [f for f in files if f.startswith("rng/")]
            if len(rng_files) != dist.get_world_size():
                raise RuntimeError(
                    f"checkpoint {tmp}: {len(rng_files)} RNG files for "
                    f"{dist.get_world_size()} ranks"
                )
            meta = {
                "format_version": FORMAT_VERSION,
                "iteration": run.iteration,
                "model": {k: getattr(run.model_config, k) for k in MODEL_FIELDS},
                "padded_vocab_size": run.model_config.vocab_size,
                "vocab_size": run.train_data.corpus.vocab_size,
                "tokenizer": run.train_data.corpus.manifest.get("tokenizer"),
                "layout": layout_of(run),
                "config": run.config.to_dict(),
                "data": run.train_data.state_dict(),
                "optimizer": {
                    "adam_step": run.optimizer.adam_step(),
                    "grad_scaler": (
                        {k: float(v) for k, v in run.optimizer.grad_scaler.state_dict().items()}
                        if run.optimizer.grad_scaler
                        else None
                    ),
                    "num_skipped_steps": run.optimizer.num_skipped_steps,
                },
                "files": files,
            }
            publish(tmp, final, meta)
            if keep > 0:
                for old in sorted(ckpt.glob("iter_*"))[:-keep]:
                    shutil.rmtree(old, ignore_errors=True)
    except (OSError, dcp.api.CheckpointException) as e:
        # A full disk, a quota, a read-only or vanished directory: `latest` still names the
        # last complete checkpoint (it moves only in `publish`, after every file is written).
        raise CheckpointError(
            f"saving iteration {run.iteration} to {tmp} failed: {root_cause(e)}; the last "
            f"complete checkpoint in {ckpt} is untouched (free space or fix the directory, "
            "then resume from it)"
        ) from e
    dist.barrier()
    return final
