"""Loading a checkpoint, under the layout it was saved with or any other: a run's whole state
(`load_checkpoint`), the weights of a model (`load_weights`) or, offline, every tensor at
its global shape (`read_full_state`).  A checkpoint of another model is refused by name.
"""

import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from megacommon.progress import progress_bar
from megacore import parallel_state as ps
from megacore import tensor_parallel as tp
from megatrain.checkpoint.dcp import (
    Pieces,
    flat_range_boxes,
    layout_of,
    named_buffers,
    named_params,
    placed,
    tp_mesh,
    tp_place,
)
from megatrain.checkpoint.files import MODEL_FIELDS, CheckpointError, find_checkpoint, read_meta


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
    parameter name (the word embeddings keep their vocabulary padding), the expert biases
    (`STATE_BUFFERS`, fp32) by their buffers' global names beside them; optimizer state
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


def check_model_matches(
    meta: dict, model_config, vocab_size: int, where: Path, file: str = "meta.json"
) -> None:
    """Refuse a checkpoint (`where`'s meta.json, or an HF model's config.json) of another
    model, naming every field that differs."""
    saved = dict(meta["model"], vocab_size=meta["vocab_size"])
    here = {k: getattr(model_config, k) for k in MODEL_FIELDS}
    here["vocab_size"] = vocab_size
    differ = [f"{k}: saved {saved[k]}, here {here[k]}" for k in here if saved.get(k) != here[k]]
    if differ:
        raise CheckpointError(
            f"{where / file} is a checkpoint of another model ({'; '.join(differ)})"
        )


class DCPTensors:
    """A checkpoint's DCP directory (weights or optimizer state) as a load reads it: the saved
    tensors' global shapes (`shapes`) and `read(pieces)`, which fills each (offsets in the
    global tensor, view) piece of `pieces` (name -> pieces) from what was saved, whatever
    layout saved it.  A collective: every rank calls `read`, with pieces or without.

    `megatrain.hf.layout.HFTensors` is the same for a Hugging Face model's files, so a run
    starts from either (`start_from_weights`)."""

    def __init__(self, path: Path):
        self.where = Path(path)
        metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        # BytesStorageMetadata has no size: megatrain saves tensors only
        self.shapes = {k: tuple(v.size) for k, v in metadata.items() if hasattr(v, "size")}

    def read(self, pieces: dict[str, list]) -> None:
        dcp.load(
            {
                key: Pieces(self.shapes[key], chunks[0][1].dtype, chunks[0][1].device, chunks)
                for key, chunks in pieces.items()
            },
            checkpoint_id=self.where,
        )


def _saved_shape_problem(shapes: dict, key: str, like: torch.Tensor, mesh) -> str | None:
    """Why the saved tensor `key` cannot fill parameter `like`'s state here, or None."""
    if key not in shapes:
        return f"no saved tensor {key!r}"
    saved, here = shapes[key], tp_place(like, mesh)[0]
    vocab_padding = getattr(like, "partition_dim", None) == 0 and saved[1:] == here[1:]
    if saved != here and not vocab_padding:
        return f"{key} was saved with shape {saved}, here {here}"
    return None


def _within_rows(pieces: list, rows: int) -> list:
    """`pieces` of a tensor whose saved copy has `rows` rows (word embeddings padded to another
    multiple): the rows past them are padding here, zeroed and left out of the read."""
    out = []
    for at, piece in pieces:
        keep = max(0, min(piece.shape[0], rows - at[0]))
        piece[keep:].zero_()
        if keep:
            out.append((at, piece[:keep]))
    return out


def _requests(like, mesh, offsets, box, saved_shape) -> list:
    """The (global offsets, view) pieces of `box` (at `offsets` in the local tensor `like`) to
    read, cut to the saved rows where the vocabulary padding differs."""
    pieces = placed(like, mesh, offsets, box)
    here = tp_place(like, mesh)[0]
    if here and saved_shape[0] != here[0]:
        pieces = _within_rows(pieces, saved_shape[0])
    return pieces


def _load_into(targets: dict, saved, mesh: DeviceMesh) -> None:
    """Fill each target (name -> (tensor to fill, the parameter or buffer it is shaped like))
    from `saved` (`DCPTensors`, `HFTensors`); a vocabulary padded differently reads the saved
    rows and zeroes the rest.  One read for all: it is a collective, and under pipeline
    parallelism only the stages holding the word embeddings have padded tensors."""
    pieces = {}
    for name, (target, like) in targets.items():
        problem = _saved_shape_problem(saved.shapes, name, like, mesh)
        if problem:
            raise CheckpointError(f"{saved.where}: {problem}")
        pieces[name] = _requests(like, mesh, [0] * target.dim(), target, saved.shapes[name])
    saved.read({n: p for n, p in pieces.items() if p})


def saved_buffers(chunks, saved) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The `STATE_BUFFERS` of `chunks` that `saved` (`DCPTensors`, ...) holds, as `_load_into`
    takes them.  One it lacks (saved by a model without the expert bias, or by a megatrain
    that did not save it) starts from zero, with a note: the routing then differs from the
    saved run's until the biases have moved again."""
    buffers = named_buffers(chunks)
    missing = sorted(n for n in buffers if n not in saved.shapes)
    if missing and (not dist.is_initialized() or dist.get_rank() == 0):
        print(
            f"megatrain: warning: {saved.where} holds no expert bias for "
            f"model.moe_router_enable_expert_bias = true ({', '.join(missing)}): saved by a model "
            "without it, or by a megatrain that did not save it; these biases start from zero",
            flush=True,
        )
    return {n: (b, b) for n, b in buffers.items() if n in saved.shapes}


def load_weights(chunks, directory: Path, device: torch.device, optional: tuple[str, ...] = ()):
    """Fill this rank's parameters of `chunks` from the weights of checkpoint iteration
    `directory` (any layout).  A parameter whose name starts with a prefix in `optional` is
    left as it is when the checkpoint lacks it (a fine-tuning head a pretraining checkpoint
    does not hold); weights the model does not have (pretraining heads) are not read.
    Every rank calls it."""
    saved = DCPTensors(directory / "model")
    params = {
        n: p
        for n, p in named_params(chunks, loading=True).items()
        if n in saved.shapes or not n.startswith(optional)
    }
    targets = {n: (p.data, p) for n, p in params.items()} | saved_buffers(chunks, saved)
    with torch.no_grad():
        _load_into(targets, saved, tp_mesh(device))


def _read_shard_state(targets: list, params: dict, saved, mesh: DeviceMesh, key_of) -> None:
    """Fill the optimizer's `targets` (`MegatronOptimizer.load_shard_state`) from `saved`
    (`DCPTensors`, `HFTensors`): each shard's state "k" from the saved tensor
    `key_of(name, k)`, only the boxes of the shard's own ranges.  A saved tensor of another
    shape is refused, except word embeddings padded differently: the saved rows are read, the
    rest are zero."""
    keys = sorted({k for _, state in targets for k in state})
    # Every saved tensor this rank's stage needs is checked, whether or not this rank holds a
    # range of it, and the ranks agree before anyone reads: a rank that refused alone would
    # leave the others waiting in dcp.load's collectives.
    problems = [
        problem
        for name, p in params.items()
        for k in keys
        if (problem := _saved_shape_problem(saved.shapes, key_of(name, k), p, mesh))
    ]
    flag = torch.tensor([float(bool(problems))], device=mesh.device_type)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item():
        raise CheckpointError(
            f"{saved.where}: "
            + ("; ".join(problems) if problems else "another rank refused its optimizer state")
        )
    names = {p: n for n, p in params.items()}  # the last stage's tied embeddings included
    pieces: dict[str, list] = {}
    for shard, state in targets:
        boxes = flat_range_boxes(tuple(shard.param.shape), shard.start, shard.end)
        for k, flat in state.items():
            key = key_of(names[shard.param], k)
            for a, b, offsets, sizes in boxes:
                box = flat[a - shard.start : b - shard.start].view(sizes)
                requests = _requests(shard.param, mesh, offsets, box, saved.shapes[key])
                pieces.setdefault(key, []).extend(requests)
    # Every rank reads (a collective), with or without pieces of its own.
    saved.read({key: chunks for key, chunks in pieces.items() if chunks})


def _load_model_state(run, saved) -> tuple[DeviceMesh, dict]:
    """This rank's parameters and expert biases from `saved`, except FSDP2's (DTensors over
    DP: they are their fp32 masters, which the optimizer's load fills); (TP mesh, name ->
    parameter)."""
    mesh = tp_mesh(run.device)
    params = named_params(run.chunks, loading=True)
    plain = {n: (p.data, p) for n, p in params.items() if not isinstance(p, DTensor)}
    plain.update(saved_buffers(run.chunks, saved))
    with torch.no_grad():
        _load_into(plain, saved, mesh)
    return mesh, params


def start_from_weights(run, saved, meta: dict, source: str | None = None) -> dict:
    """Start training from the weights `saved` holds (`DCPTensors` of a checkpoint of weights
    only, `HFTensors` of a Hugging Face model), as training starts from an initialisation: this
    rank's parameters and buffers read at its layout, the fp32 masters read straight from the
    saved weights (in fp32, not via the run's dtype: no rounding; FSDP's sharded parameters are
    their masters), no Adam moments, step 0, iteration 0, data from the start, generators as
    `build_run` seeded them.  Returns `meta` at iteration 0."""
    mesh, params = _load_model_state(run, saved)
    run.optimizer.load_shard_state(
        lambda targets: _read_shard_state(targets, params, saved, mesh, lambda name, _: name),
        adam_step=0,
    )
    if dist.get_rank() == 0:
        print(
            f"megatrain: {source or saved.where} holds weights only (no optimizer state): "
            "training starts from them at iteration 0 with fresh Adam moments",
            flush=True,
        )
    return {**meta, "iteration": 0}


def load_checkpoint(run, ckpt: str | Path) -> dict:
    """Restore `run` from the checkpoint `latest` names; returns its meta.json.

    Any (tp, pp, dp) layout loads any other, the expert biases with the weights (ones the
    checkpoint lacks start from zero, with a warning: `saved_buffers`); RNG states are
    restored only under the
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
            f"the corpus {run.train_data.corpus.path} has {here_tok['sha256']}"
        )
    weights = DCPTensors(directory / "model")
    if not has_optimizer_state(meta):
        return start_from_weights(run, weights, meta, str(directory))
    mesh, params = _load_model_state(run, weights)
    optimizer = DCPTensors(directory / "optimizer")
    run.optimizer.load_shard_state(
        lambda targets: _read_shard_state(
            targets, params, optimizer, mesh, lambda name, k: f"{name}/{k}"
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
