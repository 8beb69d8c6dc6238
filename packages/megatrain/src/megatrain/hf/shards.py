"""Hugging Face weight files as transformers writes them, a tensor at a time: shards of at most
`--max-shard-size` (transformers' `max_shard_size` syntax) named `model-0000i-of-0000N.safetensors`
with `model.safetensors.index.json` (one file: `model.safetensors`, no index).

The shards are planned before any tensor is read (every tensor's name, shape and dtype is known
from the checkpoint), so each file's safetensors header is written first and each tensor goes
to its offset when it is ready (`ShardWriter.put`): nothing waits for a shard to fill, and an
export holds the tensor it is assembling, not a shard.  `export_streamed` cuts the HF tensors of
a decoder from a checkpoint's saved pieces through the decoder's `tensor_map` read backwards.
"""

import json
import math
import os
import re
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from megatrain.hf.tensor_map import Target, hf_sources, overlap

SAFETENSORS_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
DEFAULT_MAX_SHARD_SIZE = "5GB"
# Bytes of saved pieces read per `dcp.load` call by `export_streamed` (each call reads the
# checkpoint's metadata again).
READ_GROUP_BYTES = 1 << 26


def parse_shard_size(value: int | str) -> int:
    """Bytes of a `max_shard_size` as transformers reads it: an int, or "5GB" (10^9), "5GiB"
    (2^30), "500MB", "100KB", ...; a bit unit ("5Gb") is an eighth."""
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"--max-shard-size {value}: expected a positive size")
        return value
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?[Bb])?\s*", str(value))
    if not match:
        raise ValueError(
            f"--max-shard-size {value!r}: expected bytes or a size such as 5GB, 500MB, 2GiB"
        )
    number, unit = float(match.group(1)), match.group(2) or "B"
    power = "KMGT".find(unit[0]) + 1 if unit != "B" else 0
    scale = (1024 if "i" in unit else 1000) ** power
    size = int(number * scale / (8 if unit.endswith("b") else 1))
    if size <= 0:
        raise ValueError(f"--max-shard-size {value!r}: expected a positive size")
    return size


def plan_shards(
    tensors: list[tuple[str, tuple[int, ...]]],
    dtype: torch.dtype,
    max_bytes: int,
    fp32: frozenset[str] = frozenset(),
) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    """File name -> its tensors, in order, each file at most `max_bytes` unless one tensor is
    larger (it then has a file of its own), as transformers shards; the tensors `fp32` names
    in float32, the rest in `dtype`."""
    size = torch.empty((), dtype=dtype).element_size()
    shards, current, current_bytes = [], [], 0
    for name, shape in tensors:
        nbytes = (4 if name in fp32 else size) * math.prod(shape)
        if current and current_bytes + nbytes > max_bytes:
            shards.append(current)
            current, current_bytes = [], 0
        current.append((name, shape))
        current_bytes += nbytes
    if current:
        shards.append(current)
    if len(shards) == 1:
        return {"model.safetensors": shards[0]}
    n = len(shards)
    return {f"model-{i + 1:05d}-of-{n:05d}.safetensors": s for i, s in enumerate(shards)}


class ShardWriter:
    """Safetensors files of a plan (`plan_shards`) in `dtype` (the tensors `fp32` names, DeepSeek's
    expert biases, in float32), written a tensor at a time at its offset (`put`, any order);
    `close` checks that every tensor came and writes the index.  Files are readable as the
    user's others are (safetensors' own writer makes them 0600).  `create=False`: the files
    exist (another writer made them), and this one fills the tensors of its `plan`, a part of
    theirs (`export_parallel`'s workers)."""

    def __init__(
        self,
        out: Path,
        plan: dict[str, list],
        dtype: torch.dtype,
        create=True,
        fp32: frozenset[str] = frozenset(),
    ):
        self.out, self.plan, self.dtype, self.fp32 = Path(out), plan, dtype, frozenset(fp32)
        self.size = torch.empty((), dtype=dtype).element_size()
        self.where: dict[str, tuple[str, int, tuple]] = {}  # name -> (file, offset, shape)
        self.done: set[str] = set()
        self.total = 0
        umask = os.umask(0)
        os.umask(umask)
        for file, tensors in plan.items():
            header, offset = {"__metadata__": {"format": "pt"}}, 0
            for name, shape in tensors:
                kind = self.dtype_of(name)
                end = offset + kind.itemsize * math.prod(shape)
                header[name] = {"dtype": SAFETENSORS_NAMES[kind], "shape": list(shape),
                                "data_offsets": [offset, end]}  # fmt: skip
                offset = end
            raw = json.dumps(header, separators=(",", ":")).encode()
            raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
            start = 8 + len(raw)
            if create:
                with open(self.out / file, "wb") as f:
                    f.write(len(raw).to_bytes(8, "little") + raw)
                    f.truncate(start + offset)
                os.chmod(self.out / file, 0o666 & ~umask)
            for name, shape in tensors:
                self.where[name] = (file, start + header[name]["data_offsets"][0], shape)
            self.total += offset
        self.handles: dict[str, object] = {}

    def dtype_of(self, name: str) -> torch.dtype:
        return torch.float32 if name in self.fp32 else self.dtype

    def put(self, name: str, t: torch.Tensor) -> None:
        file, offset, shape = self.where[name]
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"{name}: shape {tuple(t.shape)}, planned {shape}")
        if file not in self.handles:
            self.handles[file] = open(self.out / file, "r+b")  # noqa: SIM115 (closed in close)
        f = self.handles[file]
        f.seek(offset)
        f.write(t.to(self.dtype_of(name)).contiguous().view(torch.uint8).numpy().tobytes())
        self.done.add(name)

    def close(self, done: set[str] | None = None) -> None:
        """Close the files; check that every tensor was written (here, or by the writers
        that report `done`) and write the index."""
        for f in self.handles.values():
            f.close()
        self.handles.clear()
        missing = [n for n in self.where if n not in (done or self.done)]
        if missing:
            raise RuntimeError(f"export wrote no {missing[:5]}")
        if len(self.plan) > 1:
            index = {
                "metadata": {"total_size": self.total},
                "weight_map": {name: file for name, (file, _, _) in self.where.items()},
            }
            (self.out / "model.safetensors.index.json").write_text(
                json.dumps(index, indent=2) + "\n"
            )


def save_weights(weights: dict, dtype: torch.dtype, out: Path, max_shard_size=None) -> None:
    """Whole tensors as HF weight files in `dtype`, sharded as `plan_shards` plans."""
    max_bytes = parse_shard_size(max_shard_size or DEFAULT_MAX_SHARD_SIZE)
    plan = plan_shards([(n, tuple(t.shape)) for n, t in weights.items()], dtype, max_bytes)
    writer = ShardWriter(out, plan, dtype)
    for name, t in weights.items():
        writer.put(name, t)
    writer.close()


def export_streamed(
    model_dir: Path, targets: dict[str, Target], writer: ShardWriter, progress=None
) -> None:
    """Every HF tensor of `targets` (our tensor -> its HF boxes) cut from the checkpoint's DCP
    directory `model_dir`, reading its saved pieces a group at a time (at most
    `READ_GROUP_BYTES`, or one piece), each HF tensor handed to `writer` once its last box is
    in: what is held is the group read and the HF tensors it has begun."""
    from megatrain.checkpoint.dcp import Pieces
    from megatrain.checkpoint.files import CheckpointError

    metadata = dcp.FileSystemReader(str(model_dir)).read_metadata().state_dict_metadata
    wanted = {name for name, srcs in hf_sources(targets).items() if name in writer.where}
    pending: dict[str, list] = {}  # HF name -> [tensor, elements still to come]
    shapes = {n: s for n, (_, _, s) in writer.where.items()}

    def take(name: str, offsets, piece: torch.Tensor) -> None:
        for s in targets[name].sources:
            if s.hf not in wanted:
                continue
            meet = overlap(list(offsets), list(piece.shape), list(s.at), list(s.size))
            if meet is None:
                continue
            start, extent = meet
            box = piece[
                tuple(
                    slice(a - o, a - o + m) for a, o, m in zip(start, offsets, extent, strict=True)
                )
            ]
            n = len(s.start)
            box = box.reshape(extent[len(extent) - n :])
            rel = [a - b for a, b in zip(start, s.at, strict=True)][len(start) - n :]
            if s.transpose:
                box, rel = box.transpose(-1, -2), [*rel[:-2], rel[-1], rel[-2]]
            columns = slice(None)
            if s.step > 1:  # every step-th column of the HF tensor's span
                rel[-1] *= s.step
                columns = slice(None, None, s.step)
            if s.hf not in pending:
                pending[s.hf] = [
                    torch.empty(shapes[s.hf], dtype=writer.dtype_of(s.hf)),
                    math.prod(shapes[s.hf]),
                ]
            entry = pending[s.hf]
            at = list(zip(s.start, rel, box.shape, strict=True))
            index = [slice(a + r, a + r + m) for a, r, m in at]
            if s.step > 1:
                a, r, m = at[-1]
                index[-1] = slice(a + r, a + r + (m - 1) * s.step + 1)
            entry[0][tuple(index)][..., columns].copy_(box)
            entry[1] -= box.numel()
            if entry[1] == 0:
                writer.put(s.hf, entry[0])
                del pending[s.hf]
                if progress is not None:
                    progress.update(entry[0].nbytes)

    group, group_bytes = [], 0

    def flush():
        if not group:
            return
        state: dict[str, list] = {}
        for name, offsets, buf in group:
            state.setdefault(name, []).append((offsets, buf))
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(
                {n: Pieces(metadata[n].size, ps[0][1].dtype, "cpu", ps) for n, ps in state.items()},
                checkpoint_id=model_dir,
                no_dist=True,
            )
        for name, offsets, buf in group:
            take(name, offsets, buf)
        group.clear()

    for name, target in targets.items():
        if not any(s.hf in wanted for s in target.sources):
            continue
        item = metadata.get(name)
        if item is None or not hasattr(item, "chunks"):
            raise CheckpointError(f"{model_dir}: no saved tensor {name!r}")
        if tuple(item.size[1:]) != tuple(target.shape[1:]) or item.size[0] < max(
            s.at[0] + s.size[0] for s in target.sources
        ):
            raise CheckpointError(
                f"{model_dir}: {name} was saved with shape {tuple(item.size)}, the model's "
                f"config says {target.shape}"
            )
        for chunk in item.chunks:
            buf = torch.empty(tuple(chunk.sizes), dtype=item.properties.dtype)
            if group and group_bytes + buf.nbytes > READ_GROUP_BYTES:
                flush()
                group_bytes = 0
            group.append((name, list(chunk.offsets), buf))
            group_bytes += buf.nbytes
    flush()
    if pending:
        raise CheckpointError(f"{model_dir}: the saved pieces do not cover {sorted(pending)[:5]}")


def _export_part(
    model_dir: Path, targets: dict, out: Path, plan: dict, dtype, fp32: frozenset
) -> set[str]:
    """One worker of `export_parallel`: the tensors of its shards `plan`."""
    writer = ShardWriter(out, plan, dtype, create=False, fp32=fp32)
    export_streamed(model_dir, targets, writer)
    for f in writer.handles.values():
        f.close()
    return writer.done


def export_parallel(
    model_dir: Path, targets: dict, writer: ShardWriter, workers: int, progress=None
) -> None:
    """`export_streamed` by a pool of `workers` processes, each reading the saved pieces of the
    shards it is given (whole shard files, in turns) and writing them into the files `writer`
    made; `writer` is then closed with what they wrote.  One worker: in this process."""
    if workers <= 1 or len(writer.plan) == 1:
        export_streamed(model_dir, targets, writer, progress)
        writer.close()
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    files = list(writer.plan)
    parts = [{f: writer.plan[f] for f in files[i::workers]} for i in range(workers)]
    parts = [p for p in parts if p]
    done: set[str] = set()
    # spawn: a forked child of a process that ran torch's OpenMP threads can hang in them.
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(len(parts), mp_context=context) as pool:
        futures = [
            pool.submit(
                _export_part, model_dir, targets, writer.out, part, writer.dtype, writer.fp32
            )
            for part in parts
        ]
        for future, part in zip(futures, parts, strict=True):
            done |= future.result()
            if progress is not None:
                progress.update(sum(math.prod(s) * writer.dtype_of(n).itemsize
                                    for p in part.values() for n, s in p))  # fmt: skip
    writer.close(done)
