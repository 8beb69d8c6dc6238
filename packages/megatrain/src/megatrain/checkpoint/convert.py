"""Offline checkpoint conversion (`megatrain convert`) and the offline checkpoint writer.

One process, no process group, CPU.  The checkpoint format is layout-free: every
tensor is saved at its global shape and torch.distributed.checkpoint reads back
whatever slices a (tp, pp, dp) layout needs.  So converting a checkpoint to
another layout moves no bytes: `--tp/--pp` only check that the model can be
split that way and record the target in meta.json.  What a conversion does
change is the stored dtype of the weights (the optimizer's fp32 masters and Adam
moments stay fp32) and, with `weights_only`, the optimizer state, which it drops.

The output is written as `save_checkpoint` writes: into `.tmp-iter_N/`, sizes
recorded in meta.json, renamed to `iter_N/`, `latest` written last.  RNG files are
not copied: generator states only mean something at the layout that saved them,
and a run at any layout seeds its generators from the iteration instead.
"""

import shutil
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

from megacommon.progress import progress_bar
from megatrain import __version__
from megatrain.checkpoint.dcp import STATE_BUFFERS, shard_write_items
from megatrain.checkpoint.files import (
    FORMAT_VERSION,
    CheckpointError,
    find_checkpoint,
    iteration_dir,
    read_meta,
)
from megatrain.checkpoint.load import has_optimizer_state, read_full_state
from megatrain.checkpoint.save import file_sizes, publish
from megatrain.inference.load import check_layout

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_of(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r}: expected one of {', '.join(DTYPES)}")
    return DTYPES[name]


class Streamed(torch.Tensor):
    """A tensor of global shape `size` that DCP writes a piece at a time, each piece made
    (`chunks`: (offsets, sizes, make())) only when the writer reaches it, so an offline
    conversion holds one piece, not the model.

    DCP's file writer keeps a reference to the last piece of every tensor it wrote until the
    file is complete (it needs them for its safetensors format only; ours is torch.save's): so
    making a piece frees the storage of the piece made before it, which the writer has written
    by then (`_save_dir` asks for its serial loader: `per_thread_copy_ahead=0`).  No
    operation runs on it: it only carries the pieces into DCP.
    """

    @staticmethod
    def __new__(cls, size, dtype: torch.dtype, chunks: list[tuple[tuple, tuple, Callable]]):
        r = torch.Tensor._make_wrapper_subclass(cls, torch.Size(size), dtype=dtype)
        r._chunks = {torch.Size(o): (torch.Size(sizes), make) for o, sizes, make in chunks}
        r._held = None  # set by `_save_dir`: what one save shares (the last piece, progress)
        return r

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"{func} on a Streamed checkpoint tensor (DCP only writes it)")

    def __repr__(self):
        return f"Streamed(size={tuple(self.shape)}, {len(self._chunks)} pieces)"

    def __create_write_items__(self, fqn: str, obj) -> list:
        boxes = [(offsets, sizes) for offsets, (sizes, _) in self._chunks.items()]
        return shard_write_items(fqn, self.size(), self.dtype, boxes)

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=o, sizes=s) for o, (s, _) in self._chunks.items()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        held = self._held
        if held["last"] is not None:  # written by now: its bytes are in the file
            held["last"].untyped_storage().resize_(0)
        sizes, make = self._chunks[torch.Size(index.offset)]
        piece = make().to(self.dtype).contiguous()
        if piece.shape != sizes:
            raise ValueError(f"{index.fqn}: a piece of shape {tuple(piece.shape)}, not {sizes}")
        held["last"] = piece
        held["bar"].update(piece.nbytes)
        return piece


def _save_dir(state: dict, path: Path, progress: bool = False) -> None:
    """One DCP directory (weights or optimizer state) of plain or `Streamed` tensors."""
    streamed = [t for t in state.values() if isinstance(t, Streamed)]
    total = sum(t.numel() * t.element_size() for t in streamed)
    bar = progress_bar(
        total, f"writing {path}", "B", enabled=progress and bool(streamed), unit_scale=True
    )
    held = {"last": None, "bar": bar}
    for t in streamed:
        t._held = held
    state = {n: t if isinstance(t, Streamed) else t.contiguous() for n, t in state.items()}
    with bar:
        dcp.save(
            state,
            storage_writer=dcp.FileSystemWriter(str(path), per_thread_copy_ahead=0),
            no_dist=True,
        )
    held["last"] = None


def write_checkpoint(
    out: str | Path,
    meta: dict,
    weights: dict[str, torch.Tensor],
    optimizer: dict[str, torch.Tensor] | None,
    tokenizer_bytes: bytes | None,
    progress: bool = False,
) -> Path:
    """Write a complete checkpoint of `meta["iteration"]` under `out` from whole tensors
    (plain tensors, which DCP reads back at any layout, or `Streamed` ones, made a piece at a
    time as they are written); returns the iteration directory.

    `optimizer` None: a checkpoint of weights only (meta "optimizer" must then be None).
    An existing iteration directory of that number is refused, not replaced.
    """
    out = Path(out)
    final = iteration_dir(out, meta["iteration"])
    if final.exists():
        raise CheckpointError(
            f"{final} already exists: remove it or write the converted checkpoint elsewhere"
        )
    if (optimizer is None) != (meta.get("optimizer") is None):
        raise ValueError("write_checkpoint: meta['optimizer'] must be None exactly without state")
    tmp = out / f".tmp-{final.name}"
    shutil.rmtree(tmp, ignore_errors=True)  # left by a conversion that was killed
    tmp.mkdir(parents=True)
    with warnings.catch_warnings():
        # DCP warns that it runs without a process group: here that is the point.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        _save_dir(weights, tmp / "model", progress)
        if optimizer is not None:
            _save_dir(optimizer, tmp / "optimizer")
    if tokenizer_bytes is not None:
        (tmp / "tokenizer.json").write_bytes(tokenizer_bytes)
    meta = {
        **meta,
        "format_version": FORMAT_VERSION,
        "megatrain_version": __version__,
        "files": file_sizes(tmp),
    }
    publish(tmp, final, meta)
    return final


def convert(
    ckpt: str | Path,
    out: str | Path,
    dtype: str = "float32",
    weights_only: bool = False,
    tp: int | None = None,
    pp: int | None = None,
    progress: bool = True,
) -> Path:
    """Rewrite the checkpoint `latest` of `ckpt` names under `out`, at the same iteration:
    weights cast to `dtype`, optimizer state (fp32) kept unless `weights_only`, RNG files
    dropped, and `tp`/`pp` (checked) recorded as the target layout."""
    torch_dtype = dtype_of(dtype)
    directory = find_checkpoint(ckpt)
    meta = read_meta(directory)
    if Path(out).resolve() == Path(ckpt).resolve():
        raise CheckpointError(f"--out {out} is the input checkpoint; write the result elsewhere")
    saved = meta.get("layout") or {}
    tp = tp or saved.get("tensor_model_parallel_size") or 1
    pp = pp or saved.get("pipeline_model_parallel_size") or 1
    config = check_layout(meta, tp, pp, directory)
    keep_optimizer = has_optimizer_state(meta) and not weights_only
    meta, state = read_full_state(ckpt, with_optimizer=keep_optimizer, progress=progress)
    weights = {  # the expert biases stay fp32 (`STATE_BUFFERS`)
        n: t if n.endswith(STATE_BUFFERS) else t.to(torch_dtype)
        for n, t in state.items()
        if "/" not in n
    }
    optimizer = {n: t.float() for n, t in state.items() if "/" in n} if keep_optimizer else None
    converted = {
        **meta,
        "dtype": dtype,
        "layout": {
            "world_size": None,  # the target is tp x pp only; dp is whatever a run has
            "tensor_model_parallel_size": tp,
            "pipeline_model_parallel_size": pp,
            "virtual_pipeline_model_parallel_size": None,
            "data_parallel_size": None,
            "use_distributed_optimizer": None,
        },
        "config": config.to_dict(),
        "converted_from": {
            "checkpoint": str(directory),
            "dtype": meta.get("dtype"),
            "layout": meta.get("layout"),
            "rng": "dropped: generator states only apply at the layout that saved them",
        },
    }
    if not keep_optimizer:
        # Weights only: a run starts from them at iteration 0, with fresh Adam and data order.
        converted.update(optimizer=None, data=None)
    tokenizer = directory / "tokenizer.json"
    tokenizer_bytes = tokenizer.read_bytes() if tokenizer.is_file() else None
    return write_checkpoint(out, converted, weights, optimizer, tokenizer_bytes)
