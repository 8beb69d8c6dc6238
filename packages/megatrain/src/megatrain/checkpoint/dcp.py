"""How parameters and optimizer shards meet torch.distributed.checkpoint.

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
tensor, as the chunks of one tensor (`Pieces`): DCP writes only local data and
checks at save that the chunks of all ranks tile every tensor exactly once, and
a loader asks only for the boxes of its own ranges, read straight into its
masters and new moment tensors.  So no rank holds more optimizer state than its
own shard, plus, while loading, one saved chunk (at most one parameter of the
saving layout) that DCP reads and narrows.  What lands on disk is the same
global tensor a gather would have written: the format does not depend on tp,
pp, dp or the distributed optimizer, and the offline readers see whole tensors.

Expert weights of a mixture of experts are saved whole too, by global expert id:
`experts.weight1` [E, h, f or 2f], `experts.weight2` [E, f, h], whatever the expert
layout.  A rank's [E / ep, h, f / etp] is one box of it (`ExpertLayout`, set on the
parameter by `megatrain.parallelize.apply_expert_parallel`), two under SwiGLU at etp > 1
(its gate columns and its up columns, which lie apart in [gate | up]); `placed` cuts a
local box (a whole parameter, or a box of a flat range) into its pieces of the global
tensor, so any ep x etp reads what any other wrote.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from megacore import parallel_state as ps
from megacore.distributed import DistributedDataParallel
from megatrain.checkpoint.files import CheckpointError


def module_of(chunk):
    return chunk.module if isinstance(chunk, DistributedDataParallel) else chunk


def named_params(chunks, loading: bool = False) -> dict[str, torch.nn.Parameter]:
    """Global name -> parameter for this rank's chunks.

    The last stage's copy of the tied word embeddings is not saved (the first stage
    saves the one matrix); when loading it reads that matrix, under its name.
    """
    out = {}
    for chunk in chunks:
        for name, p in module_of(chunk).named_parameters():
            if name == "output_weight":
                if not loading:
                    continue
                name = "embedding.weight"
            out[name] = p
    return out


# Model state that is not a parameter, saved with the weights under its global name: DeepSeek-
# V3's expert bias (`moe_router_enable_expert_bias`), moved each step by the token counts,
# not by the optimizer.  Every rank holding the layer holds the same values (the counts are
# summed over the stage), so it is saved as a replicated tensor (DCP writes it once) and
# kept in fp32 whatever the weights' dtype (Megatron's), by `convert` too.
STATE_BUFFERS = ("router.expert_bias",)


def named_buffers(chunks) -> dict[str, torch.Tensor]:
    """Global name -> buffer for this rank's chunks' `STATE_BUFFERS`."""
    return {
        name: b
        for chunk in chunks
        for name, b in module_of(chunk).named_buffers()
        if name.endswith(STATE_BUFFERS)
    }


def tp_mesh(device: torch.device) -> DeviceMesh:
    return DeviceMesh.from_group(ps.get_tensor_model_parallel_group(), device.type)


def tp_split(like: torch.nn.Parameter, mesh: DeviceMesh) -> int | None:
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


def global_tensor(p: torch.Tensor, like: torch.nn.Parameter, mesh: DeviceMesh, writing=False):
    """A tensor shaped like parameter `like` as DCP should see it: its global shape (an
    expert parameter: the pieces of it this rank holds, views of `p`; with `writing`, as
    `written_pieces` hands them to DCP)."""
    layout = getattr(like, "expert_layout", None)
    if layout is not None:
        pieces = placed(like, mesh, [0] * p.dim(), p)
        pieces = written_pieces(pieces) if writing else pieces
        return Pieces(layout.shape, p.dtype, p.device, pieces)
    dim = tp_split(like, mesh)
    return p if dim is None else DTensor.from_local(p, mesh, [Shard(dim)], run_check=False)


@dataclass(frozen=True)
class Region:
    """A box of a local parameter (`local` start, `size`) and where it lies in the global
    tensor (`at`)."""

    local: tuple[int, ...]
    size: tuple[int, ...]
    at: tuple[int, ...]


@dataclass(frozen=True)
class ExpertLayout:
    """An expert parameter's global shape and the regions of it this rank holds."""

    shape: tuple[int, ...]
    regions: tuple[Region, ...]


def expert_layout(
    local_shape, num_experts: int, first: int, etp_rank: int, etp: int, split_dim: int, halves: int
) -> ExpertLayout:
    """The layout of a rank's expert weight [E_local, ...]: experts [first, first + E_local)
    of `num_experts`, dimension `split_dim` split over `etp` ranks, in `halves` parts apart
    (2 for SwiGLU's [gate | up] columns: each rank holds its slice of each half)."""
    shape, size = list(local_shape), list(local_shape)
    shape[0] = num_experts
    shape[split_dim] *= etp
    piece = local_shape[split_dim] // halves
    size[split_dim] = piece
    regions = []
    for half in range(halves):
        local, at = [0] * len(shape), [0] * len(shape)
        local[split_dim] = half * piece
        at[0] = first
        at[split_dim] = half * piece * etp + etp_rank * piece
        regions.append(Region(tuple(local), tuple(size), tuple(at)))
    return ExpertLayout(tuple(shape), tuple(regions))


def placed(
    like: torch.nn.Parameter, mesh: DeviceMesh, offsets, box: torch.Tensor
) -> list[tuple[list[int], torch.Tensor]]:
    """`box` (a tensor at `offsets` in the local parameter `like`) as (offsets in the global
    tensor, view of `box`) pieces: one for a dense parameter, a piece per region it meets
    for an expert one."""
    layout = getattr(like, "expert_layout", None)
    if layout is None:
        _, tp_offsets = tp_place(like, mesh)
        return [([o + t for o, t in zip(offsets, tp_offsets, strict=True)], box)]
    out = []
    for r in layout.regions:
        lo = [max(o, a) for o, a in zip(offsets, r.local, strict=True)]
        hi = [
            min(o + n, a + m)
            for o, n, a, m in zip(offsets, box.shape, r.local, r.size, strict=True)
        ]
        if any(a >= b for a, b in zip(lo, hi, strict=True)):
            continue
        piece = box[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offsets, strict=True))]
        out.append(([t + a - s for t, a, s in zip(r.at, lo, r.local, strict=True)], piece))
    return out


def written_pieces(pieces: list) -> list:
    """Pieces as DCP writes them, each still a view of the run's tensor: a contiguous one as
    `own_storage`, a strided one (an expert's gate or up columns at etp > 1) as it is.

    Never copied here: a copy of each strided piece, made when the save's state is put
    together, would live until the write ends, every expert weight's and each of its
    optimizer states' at once (GBs of GPU memory at the first save, counted nowhere).  The
    writer copies one piece at a time instead: DCP's file writer brings each tensor to the
    host as it writes it (a strided GPU view through a temporary of that piece's size; a
    strided CPU one cloned, as it clones any view of a larger storage), and a background
    save copies each piece into its host buffer."""
    return [(o, own_storage(t) if t.is_contiguous() else t) for o, t in pieces]


def tp_place(like: torch.nn.Parameter, mesh: DeviceMesh) -> tuple[tuple[int, ...], list[int]]:
    """(global shape, offset of this rank's TP shard in it) of parameter `like`, as `global_tensor`
    places it: TP shards of equal size along the split dimension, in TP rank order.  An
    expert parameter: its global shape and its first region's offset (`placed` has all)."""
    layout = getattr(like, "expert_layout", None)
    if layout is not None:
        return layout.shape, list(layout.regions[0].at)
    shape, offsets = list(like.shape), [0] * like.dim()
    dim = tp_split(like, mesh)
    if dim is not None:
        offsets[dim] = mesh.get_local_rank() * shape[dim]
        shape[dim] *= mesh.size()
    return tuple(shape), offsets


def own_storage(t: torch.Tensor) -> torch.Tensor:
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


def shard_write_items(fqn: str, size: torch.Size, dtype: torch.dtype, boxes) -> list[WriteItem]:
    """DCP's write items for the (offsets, sizes) boxes of a tensor of global `size`."""
    return [
        WriteItem(
            index=MetadataIndex(fqn, offsets),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                properties=TensorProperties(dtype=dtype),
                size=size,
            ),
        )
        for offsets, sizes in boxes
    ]


class Pieces(torch.Tensor):
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
        raise NotImplementedError(f"{func} on a checkpoint's Pieces (DCP only reads its pieces)")

    def __repr__(self):
        return f"Pieces(size={tuple(self.shape)}, {len(self._pieces)} pieces)"

    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        boxes = [(offsets, t.size()) for offsets, t in self._pieces.items()]
        return shard_write_items(fqn, self.size(), self.dtype, boxes)

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=o, sizes=t.size()) for o, t in self._pieces.items()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self._pieces[torch.Size(index.offset)]


def root_cause(e: BaseException) -> str:
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


def layout_of(run) -> dict:
    """The layout a run is saved with (meta.json's "layout"); a load at the same one also
    restores each rank's generators."""
    p = run.config.parallel
    layout = {
        "world_size": dist.get_world_size(),
        "tensor_model_parallel_size": p.tensor_model_parallel_size,
        "pipeline_model_parallel_size": p.pipeline_model_parallel_size,
        "virtual_pipeline_model_parallel_size": p.virtual_pipeline_model_parallel_size,
        "data_parallel_size": run.dp_size,
        "use_distributed_optimizer": p.use_distributed_optimizer,
    }
    if p.expert_model_parallel_size > 1 or p.expert_tensor_parallel_size is not None:
        layout["expert_model_parallel_size"] = p.expert_model_parallel_size
        layout["expert_tensor_parallel_size"] = p.expert_tensor_parallel_size
    return layout
