"""Checkpoints: written completely before `latest` moves, loadable under another layout.

```
<ckpt>/latest                      the newest complete iteration, e.g. "iter_0000200"
<ckpt>/iter_0000200/meta.json      iteration, run and model config, layout, tokenizer, data
                                   position, Adam step, loss scaler, sizes of every file below
<ckpt>/iter_0000200/model/         torch.distributed.checkpoint: weights by global name
<ckpt>/iter_0000200/optimizer/     the same for the fp32 masters and Adam moments
<ckpt>/iter_0000200/rng/rank-N.pt  each rank's generator states (tensors only)
<ckpt>/iter_0000200/tokenizer.json the corpus tokenizer
```

Weights and optimizer state are saved per parameter at its global shape: a
tensor-parallel shard as a DTensor over the TP group (torch.distributed.checkpoint
writes each shard once and reads back whatever slices another layout needs), a
replicated one as a plain tensor.  The word embeddings are padded to a multiple
of 128 x tp; a layout with another padding reads the saved rows and keeps its
own padding rows at zero.

Optimizer state is saved and loaded per shard, never gathered.  Under the
distributed optimizer a rank holds a flat range [start, end) of each (TP-local)
parameter; a flat range of a row-major tensor is a few rectangular boxes (a
partial row, whole rows, a partial row, recursively), each a contiguous piece of
the range.  Each rank hands DCP its boxes, at their offsets in the global
tensor, as the chunks of one tensor (`_Pieces`): DCP writes only local data and
checks at save that the chunks of all ranks tile every tensor exactly once, and
a loader asks only for the boxes of its own ranges, read straight into its
masters and new moment tensors.  So no rank holds more optimizer state than its
own shard, plus, while loading, one saved chunk (at most one parameter of the
saving layout) that DCP reads and narrows.  What lands on disk is the same
global tensor a gather would have written: the format does not depend on tp,
pp, dp or the distributed optimizer, and the offline readers see whole tensors.

A save goes to `.tmp-iter_N/`, is checked (every rank's files present, sizes
recorded in meta.json), renamed to `iter_N/`, and only then is `latest`
replaced (write to a temporary file, rename).  A process killed during a save
leaves the previous checkpoint and `latest` as they were.  Nothing is
unpickled: DCP reads tensors, RNG files load with `weights_only=True`.
"""

import json
import os
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from megacore import parallel_state as ps
from megacore import tensor_parallel as tp
from megacore.distributed import DistributedDataParallel
from megatrain.checkpoint_files import (
    FORMAT_VERSION,
    LATEST,
    CheckpointError,
    find_checkpoint,
    iteration_dir,
    read_meta,
)
from megatrain.progress import progress_bar

# Fields that make two models different: a checkpoint of another shape is refused with them.
MODEL_FIELDS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "ffn_hidden_size",
    "max_position_embeddings",
)
OPTIMIZER_STATES = ("master", "exp_avg", "exp_avg_sq")


def _module(chunk):
    return chunk.module if isinstance(chunk, DistributedDataParallel) else chunk


def named_params(chunks, loading: bool = False) -> dict[str, torch.nn.Parameter]:
    """Global name -> parameter for this rank's chunks.

    The last stage's copy of the tied word embeddings is not saved (the first stage
    saves the one matrix); when loading it reads that matrix, under its name.
    """
    out = {}
    for chunk in chunks:
        for name, p in _module(chunk).named_parameters():
            if name == "output_weight":
                if not loading:
                    continue
                name = "embedding.weight"
            out[name] = p
    return out


def _tp_mesh(device: torch.device) -> DeviceMesh:
    return DeviceMesh.from_group(ps.get_tensor_model_parallel_group(), device.type)


def _tp_split(like: torch.nn.Parameter, mesh: DeviceMesh) -> int | None:
    """The dimension parameter `like` is split along over the TP ranks here, or None."""
    if not (getattr(like, "tensor_model_parallel", False) and mesh.size() > 1):
        return None
    stride = getattr(like, "partition_stride", 1)
    if stride != 1:  # no megatrain model splits a weight this way
        raise CheckpointError(
            f"a tensor-parallel weight of shape {tuple(like.shape)} is split with stride "
            f"{stride}; checkpoints support only contiguous tensor-parallel splits"
        )
    return like.partition_dim


def _global(p: torch.Tensor, like: torch.nn.Parameter, mesh: DeviceMesh):
    """A tensor shaped like parameter `like` as DCP should see it: its global shape."""
    dim = _tp_split(like, mesh)
    return p if dim is None else DTensor.from_local(p, mesh, [Shard(dim)], run_check=False)


def _tp_place(like: torch.nn.Parameter, mesh: DeviceMesh) -> tuple[tuple[int, ...], list[int]]:
    """(global shape, offset of this rank's TP shard in it) of parameter `like`, as `_global`
    places it: TP shards of equal size along the split dimension, in TP rank order."""
    shape, offsets = list(like.shape), [0] * like.dim()
    dim = _tp_split(like, mesh)
    if dim is not None:
        offsets[dim] = mesh.get_local_rank() * shape[dim]
        shape[dim] *= mesh.size()
    return tuple(shape), offsets


def _own_storage(t: torch.Tensor) -> torch.Tensor:
    """Contiguous `t` as a tensor whose storage is exactly its bytes, sharing its memory.

    DCP's writer copies a CPU tensor that is a view into a larger storage (a parameter in
    the DDP buffer, a box of a shard) before writing it, and keeps the last piece of every
    tensor it wrote until the file is complete: one rank's share of the weights or of its
    optimizer state, copied.  A storage that is a slice of the larger one (no copy) is
    written as it is.  On a GPU DCP copies to the host anyway.
    """
    if t.device.type != "cpu" or t.untyped_storage().nbytes() == t.nbytes:
        return t
    start = t.storage_offset() * t.element_size()
    storage = t.untyped_storage()[start : start + t.nbytes]
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, 0, t.shape)


def flat_range_boxes(
    shape: tuple[int, ...], start: int, end: int
) -> list[tuple[int, int, list[int], list[int]]]:
    """Elements [start, end) of a row-major tensor of `shape` as rectangular boxes, in order:
    (first, last flat index + 1, offsets, sizes) each, every box contiguous in memory.

    A partial first row, the whole rows, a partial last row (each partial row split the same
    way one dimension down): at most 2 x dims - 1 boxes.
    """
    if start >= end:
        return []
    if len(shape) <= 1:
        return [(start, end, [start] if shape else [], [end - start] if shape else [])]
    inner = 1
    for n in shape[1:]:
        inner *= n
    first, last = start // inner, (end - 1) // inner
    if first == last:  # inside one row: that row's boxes, one dimension down
        base = first * inner
        return [
            (base + a, base + b, [first, *o], [1, *s])
            for a, b, o, s in flat_range_boxes(shape[1:], start - base, end - base)
        ]
    boxes = []
    if start % inner:  # the partial first row
        boxes += flat_range_boxes(shape, start, (first + 1) * inner)
        first += 1
    rows_end = end // inner  # rows [first, rows_end) are whole
    if rows_end > first:
        offsets, sizes = [first] + [0] * (len(shape) - 1), [rows_end - first, *shape[1:]]
        boxes.append((first * inner, rows_end * inner, offsets, sizes))
    if end % inner:  # the partial last row
        boxes += flat_range_boxes(shape, rows_end * inner, end)
    return boxes


class _Pieces(torch.Tensor):
    """A tensor of global shape `size` of which this rank holds some rectangular pieces
    (offsets -> tensor): DCP saves and loads it piece by piece through the protocol that
    DTensor implements (`__create_write_items__`, `__create_chunk_list__`,
    `__get_tensor_shard__`), so writes hold only local data and reads fill only the pieces.

    No operation runs on it (it has no storage): it only carries the pieces into DCP.
    """

    @staticmethod
    def __new__(cls, size, dtype, device, pieces: list[tuple[list[int], torch.Tensor]]):
        r = torch.Tensor._make_wrapper_subclass(cls, torch.Size(size), dtype=dtype, device=device)
        r._pieces = {torch.Size(offsets): t for offsets, t in pieces}
        return r

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"{func} on a checkpoint's _Pieces (DCP only reads its pieces)")

    def __repr__(self):
        return f"_Pieces(size={tuple(self.shape)}, {len(self._pieces)} pieces)"

    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offsets, sizes=t.size()),
                    properties=TensorProperties.create_from_tensor(t),
                    size=self.size(),
                ),
            )
            for offsets, t in self._pieces.items()
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=o, sizes=t.size()) for o, t in self._pieces.items()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self._pieces[torch.Size(index.offset)]


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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
    _write_json(tmp / "meta.json", meta)
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


def layout_of(run) -> dict:
    p = run.config.parallel
    return {
        "world_size": dist.get_world_size(),
        "tensor_model_parallel_size": p.tensor_model_parallel_size,
        "pipeline_model_parallel_size": p.pipeline_model_parallel_size,
        "virtual_pipeline_model_parallel_size": p.virtual_pipeline_model_parallel_size,
        "data_parallel_size": run.dp_size,
        "use_distributed_optimizer": p.use_distributed_optimizer,
    }


def _optimizer_pieces(run, params: dict, mesh: DeviceMesh) -> dict[str, _Pieces]:
    """This rank's optimizer state as DCP should see it: "<name>/<state>" at the parameter's
    global shape, holding the boxes of this rank's ranges (views of the optimizer's own
    tensors: nothing is copied or gathered here)."""
    names = {p: n for n, p in params.items()}  # without the last stage's tied embeddings
    pieces: dict[str, list] = {}
    shapes = {}
    for shard, state in run.optimizer.shard_state():
        name = names.get(shard.param)
        if name is None:
            continue
        shape, tp_offsets = _tp_place(shard.param, mesh)
        boxes = flat_range_boxes(tuple(shard.param.shape), shard.start, shard.end)
        for key in OPTIMIZER_STATES:
            flat = state[key]
            shapes[f"{name}/{key}"] = shape
            pieces.setdefault(f"{name}/{key}", []).extend(
                (
                    [o + t for o, t in zip(offsets, tp_offsets, strict=True)],
                    _own_storage(flat[a - shard.start : b - shard.start].view(sizes)),
                )
                for a, b, offsets, sizes in boxes
            )
    return {
        key: _Pieces(shapes[key], torch.float32, run.device, chunks)
        for key, chunks in pieces.items()
    }


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
        mesh = _tp_mesh(run.device)
        params = named_params(run.chunks)
        weights = {n: _global(_own_storage(p.detach()), p, mesh) for n, p in params.items()}
        dcp.save(weights, checkpoint_id=tmp / "model")
        dcp.save(_optimizer_pieces(run, params, mesh), checkpoint_id=tmp / "optimizer")
        torch.save(_rng_state(), tmp / "rng" / f"rank-{rank:05d}.pt")
        dist.barrier()
        if rank == 0:
            corpus_tokenizer = Path(run.config.data.corpus) / "tokenizer.json"
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
            f"saving iteration {run.iteration} to {tmp} failed: {_root_cause(e)}; the last "
            f"complete checkpoint in {ckpt} is untouched (free space or fix the directory, "
            "then resume from it)"
        ) from e
    dist.barrier()
    return final


def _root_cause(e: BaseException) -> str:
    """The OS error under torch.distributed.checkpoint's wrapping, else the error itself."""
    failures = getattr(e, "failures", None) or {}
    for failure in failures.values():  # rank -> (exception, its stack)
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, BaseException):
            e = inner
            break
    while e.__cause__ is not None and not isinstance(e, OSError):
        e = e.__cause__
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror} ({e.filename})" if e.filename else e.strerror
    return str(e).splitlines()[0]


def _load_tensors(path: Path) -> dict:
    """A file of tensors only: anything else is refused, never unpickled."""
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except Exception as e:  # torch raises UnpicklingError or RuntimeError, by version
        raise CheckpointError(
            f"{path} is not a file of tensors ({type(e).__name__}); refusing to unpickle "
            "anything else. Was it replaced or written by another program?"
        ) from e


def has_optimizer_state(meta: dict) -> bool:
    """Whether a checkpoint holds optimizer state; one from `megatrain import-hf` or
    `megatrain convert --weights-only` holds the weights only (meta.json "optimizer": null)."""
    return meta.get("optimizer") is not None


# Bytes read per `dcp.load` call by `read_full_state`: the step of its progress bar.
_READ_GROUP_BYTES = 1 << 28


def _read_dcp_dir(path: Path, progress: bool) -> dict[str, torch.Tensor]:
    """Every tensor of one DCP directory, whole, at the shape and dtype its metadata records."""
    metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    tensors = {}
    for name, item in metadata.items():
        if not hasattr(item, "size"):  # BytesStorageMetadata: megatrain saves tensors only
            raise CheckpointError(f"{path}: {name!r} is not a tensor")
        tensors[name] = torch.empty(tuple(item.size), dtype=item.properties.dtype)
    groups, group, group_bytes = [], {}, 0
    for name, tensor in tensors.items():
        group[name] = tensor
        group_bytes += tensor.numel() * tensor.element_size()
        if group_bytes >= _READ_GROUP_BYTES:
            groups.append((group, group_bytes))
            group, group_bytes = {}, 0
    if group:
        groups.append((group, group_bytes))
    total = sum(size for _, size in groups)
    bar = progress_bar(total, f"reading {path}", "B", enabled=progress, unit_scale=True)
    with bar, warnings.catch_warnings():
        # DCP warns that it runs without a process group: here that is the point.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        for group, size in groups:
            dcp.load(group, checkpoint_id=path, no_dist=True)
            bar.update(size)
    return tensors


def read_full_state(
    ckpt: str | Path, with_optimizer: bool = False, progress: bool = True
) -> tuple[dict, dict[str, torch.Tensor]]:
    """Offline (one process, no process group, CPU): (meta.json, {name: full tensor}).

    Every tensor is whole, at the global shape and dtype the DCP metadata records,
    whatever layout saved it (DCP joins the TP shards).  Weights are keyed by global
    parameter name (the word embeddings keep their vocabulary padding); optimizer state
    by "<name>/master", "<name>/exp_avg" and "<name>/exp_avg_sq".
    """
    directory = find_checkpoint(ckpt)
    meta = read_meta(directory)
    state = _read_dcp_dir(directory / "model", progress)
    if with_optimizer:
        if not has_optimizer_state(meta):
            raise CheckpointError(
                f"{directory / 'meta.json'}: the checkpoint holds weights only (no optimizer state)"
            )
        state.update(_read_dcp_dir(directory / "optimizer", progress))
    return meta, state


def check_model_matches(meta: dict, model_config, vocab_size: int, where: Path) -> None:
    """Refuse a checkpoint of another model, naming every field that differs."""
    saved = dict(meta["model"], vocab_size=meta["vocab_size"])
    here = {k: getattr(model_config, k) for k in MODEL_FIELDS}
    here["vocab_size"] = vocab_size
    differ = [f"{k}: saved {saved[k]}, here {here[k]}" for k in here if saved.get(k) != here[k]]
    if differ:
        raise CheckpointError(
            f"{where / 'meta.json'} is a checkpoint of another model ({'; '.join(differ)})"
        )


def _load_into(params: dict, prefix: str, checkpoint_id: Path, mesh: DeviceMesh) -> dict:
    """Read the saved tensors for `params` (name -> target tensor shaped like the parameter);
    a vocabulary padded differently is read whole and its saved rows copied."""
    metadata = dcp.FileSystemReader(str(checkpoint_id)).read_metadata().state_dict_metadata
    direct, padded = {}, {}
    for name, (target, like) in params.items():
        key = f"{name}{prefix}"
        if key not in metadata:
            raise CheckpointError(f"{checkpoint_id}: no saved tensor {key!r}")
        saved_shape = tuple(metadata[key].size)
        view = _global(target, like, mesh)
        global_shape = tuple(view.shape)
        if saved_shape == global_shape:
            direct[key] = view
        elif saved_shape[1:] == global_shape[1:] and getattr(like, "partition_dim", None) == 0:
            padded[key] = (torch.zeros(saved_shape, dtype=target.dtype), target, like)
        else:
            raise CheckpointError(
                f"{checkpoint_id}: {key} was saved with shape {saved_shape}, here {global_shape}"
            )
    # One read for both kinds: dcp.load is a collective, and under pipeline parallelism only
    # the stages holding the word embeddings have padded tensors.
    dcp.load({**direct, **{k: v[0] for k, v in padded.items()}}, checkpoint_id=checkpoint_id)
    for whole, target, like in padded.values():
        rows = target.shape[0]
        sharded = getattr(like, "tensor_model_parallel", False)
        start = ps.get_tensor_model_parallel_rank() * rows if sharded else 0
        with torch.no_grad():
            target.zero_()
            piece = whole[start : start + rows]
            target[: piece.shape[0]].copy_(piece)
    return direct


def load_weights(chunks, directory: Path, device: torch.device, optional: tuple[str, ...] = ()):
    """Fill this rank's parameters of `chunks` from the weights of checkpoint iteration
    `directory` (any layout).  A parameter whose name starts with a prefix in `optional` is
    left as it is when the checkpoint lacks it (a fine-tuning head a pretraining checkpoint
    does not hold); weights the model does not have (pretraining heads) are not read.
    Every rank calls it."""
    saved = dcp.FileSystemReader(str(directory / "model")).read_metadata().state_dict_metadata
    params = {
        n: p
        for n, p in named_params(chunks, loading=True).items()
        if n in saved or not n.startswith(optional)
    }
    with torch.no_grad():
        _load_into(
            {n: (p.data, p) for n, p in params.items()}, "", directory / "model", _tp_mesh(device)
        )


def _saved_shape_problem(metadata, key: str, like: torch.nn.Parameter, mesh) -> str | None:
    """Why the saved tensor `key` cannot fill parameter `like`'s state here, or None."""
    if key not in metadata:
        return f"no saved tensor {key!r}"
    if not hasattr(metadata[key], "size"):
        return f"{key!r} is not a tensor"
    saved, here = tuple(metadata[key].size), _tp_place(like, mesh)[0]
    vocab_padding = getattr(like, "partition_dim", None) == 0 and saved[1:] == here[1:]
    if saved != here and not vocab_padding:
        return f"{key} was saved with shape {saved}, here {here}"
    return None


def _read_shard_state(
    targets: list, params: dict, checkpoint_id: Path, mesh: DeviceMesh, key_of
) -> None:
    """Fill the optimizer's `targets` (`MegatronOptimizer.load_shard_state`) from the DCP
    directory `checkpoint_id`: each shard's state "k" from the saved tensor `key_of(name, k)`,
    only the boxes of the shard's own ranges.  A saved tensor of another shape is refused,
    except word embeddings padded differently: the saved rows are read, the rest are zero."""
    metadata = dcp.FileSystemReader(str(checkpoint_id)).read_metadata().state_dict_metadata
    keys = sorted({k for _, state in targets for k in state})
    # Every saved tensor this rank's stage needs is checked, whether or not this rank holds a
    # range of it, and the ranks agree before anyone reads: a rank that refused alone would
    # leave the others waiting in dcp.load's collectives.
    problems = [
        problem
        for name, p in params.items()
        for k in keys
        if (problem := _saved_shape_problem(metadata, key_of(name, k), p, mesh))
    ]
    flag = torch.tensor([float(bool(problems))], device=mesh.device_type)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item():
        raise CheckpointError(
            f"{checkpoint_id}: "
            + ("; ".join(problems) if problems else "another rank refused its optimizer state")
        )
    names = {p: n for n, p in params.items()}  # the last stage's tied embeddings included
    pieces: dict[str, list] = {}
    for shard, state in targets:
        shape, tp_offsets = _tp_place(shard.param, mesh)
        boxes = flat_range_boxes(tuple(shard.param.shape), shard.start, shard.end)
        for k, flat in state.items():
            key = key_of(names[shard.param], k)
            rows = metadata[key].size[0] if shape else 0  # differs for padded embeddings
            for a, b, offsets, sizes in boxes:
                box = flat[a - shard.start : b - shard.start].view(sizes)
                at = [o + t for o, t in zip(offsets, tp_offsets, strict=True)]
                if shape and rows != shape[0]:  # rows past the saved ones are padding: zero
                    keep = max(0, min(sizes[0], rows - at[0]))
                    box[keep:].zero_()
                    box = box[:keep]
                    if keep == 0:
                        continue
                pieces.setdefault(key, []).append((at, box))
    # Every rank calls dcp.load (a collective), with or without pieces of its own.
    dcp.load(
        {
            key: _Pieces(metadata[key].size, torch.float32, chunks[0][1].device, chunks)
            for key, chunks in pieces.items()
        },
        checkpoint_id=checkpoint_id,
    )


def _start_from_weights(run, params: dict, directory: Path, mesh: DeviceMesh, meta: dict) -> dict:
    """A checkpoint of weights only: fine-tuning starts from them, as training starts from an
    initialisation (fp32 masters read from the saved weights, no Adam moments, step 0,
    iteration 0, data from the start, generators as `build_run` seeded them)."""
    # Each shard's master is read straight from the saved weights (in fp32, not via the
    # run's dtype: no rounding).
    run.optimizer.load_shard_state(
        lambda targets: _read_shard_state(
            targets, params, directory / "model", mesh, lambda name, _: name
        ),
        adam_step=0,
    )
    if dist.get_rank() == 0:
        print(
            f"megatrain: {directory} holds weights only (no optimizer state): training starts "
            "from them at iteration 0 with fresh Adam moments",
            flush=True,
        )
    return {**meta, "iteration": 0}


def load_checkpoint(run, ckpt: str | Path) -> dict:
    """Restore `run` from the checkpoint `latest` names; returns its meta.json.

    Any (tp, pp, dp) layout loads any other; RNG states are restored only under the
    layout they were saved at (elsewhere the generators are seeded from the iteration).
    A checkpoint of weights only (`has_optimizer_state` false) starts training from its
    weights at iteration 0 (the returned meta says iteration 0).
    """
    directory = find_checkpoint(ckpt)
    meta = read_meta(directory)
    check_model_matches(meta, run.model_config, run.train_data.corpus.vocab_size, directory)
    saved_tok = meta.get("tokenizer") or {}
    here_tok = run.train_data.corpus.manifest.get("tokenizer") or {}
    if saved_tok.get("sha256") not in (None, here_tok.get("sha256")):
        raise CheckpointError(
            f"{directory / 'meta.json'}: trained with tokenizer sha256 {saved_tok['sha256']}, "
            f"the corpus {run.config.data.corpus} has {here_tok['sha256']}"
        )
    mesh = _tp_mesh(run.device)
    params = named_params(run.chunks, loading=True)
    with torch.no_grad():
        _load_into({n: (p.data, p) for n, p in params.items()}, "", directory / "model", mesh)
    if not has_optimizer_state(meta):
        return _start_from_weights(run, params, directory, mesh, meta)
    run.optimizer.load_shard_state(
        lambda targets: _read_shard_state(
            targets, params, directory / "optimizer", mesh, lambda name, k: f"{name}/{k}"
        ),
        meta["optimizer"]["adam_step"],
    )
    if run.optimizer.grad_scaler and meta["optimizer"]["grad_scaler"]:
        run.optimizer.grad_scaler.load_state_dict(meta["optimizer"]["grad_scaler"])
    run.optimizer.num_skipped_steps = meta["optimizer"]["num_skipped_steps"]
    run.train_data.load_state_dict(meta["data"])
    run.iteration = meta["iteration"]
    rng_file = directory / "rng" / f"rank-{dist.get_rank():05d}.pt"
    # `megatrain convert` drops the RNG files: they only apply at the layout that saved them.
    if meta["layout"] == layout_of(run) and rng_file.is_file():
        state = _load_tensors(rng_file)
        torch.set_rng_state(state.pop("cpu"))
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state.pop("cuda"))
        state.pop("cuda", None)
        tp.get_rng_tracker().set_states(state)
    else:
        seed = run.config.training.seed + run.iteration
        tp.model_parallel_manual_seed(seed + 100 * ps.get_pipeline_model_parallel_rank())
    return meta
