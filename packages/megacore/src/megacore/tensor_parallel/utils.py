"""Small helpers shared by the tensor-parallel pieces: checked division, shard ranges, attributes.

Parameters split over tensor-parallel ranks carry Megatron's attributes
(`tensor_model_parallel`, `partition_dim`, `partition_stride`) so that gradient
clipping, checkpoint resharding and export can tell a shard from a replica
without knowing the layer that made it.
"""

import torch

from megacore import parallel_state


def divide(numerator: int, denominator: int, what: str = "value", by: str = "divisor") -> int:
    """numerator // denominator, or a ValueError naming both numbers when it does not divide."""
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by {by} ({denominator})")
    return numerator // denominator


def divide_by_tp(numerator: int, what: str, tensor_model_parallel_size: int | None = None) -> int:
    """Split a size over the tensor-parallel ranks, refusing sizes that do not divide.

    Model code calls it for every dimension it shards (heads, ffn size, vocab), so
    a bad configuration fails on every rank at construction, before any collective.
    """
    if tensor_model_parallel_size is None:
        tensor_model_parallel_size = parallel_state.get_tensor_model_parallel_world_size()
    return divide(numerator, tensor_model_parallel_size, what, "tensor_model_parallel_size")


def vocab_size_with_padding(
    vocab_size: int, tensor_model_parallel_size: int, multiple: int = 128
) -> int:
    """Pad a vocabulary to a multiple of `multiple` x tp: 50257 -> 51200 at tp=8 (the paper)."""
    step = multiple * tensor_model_parallel_size
    return -(-vocab_size // step) * step


def vocab_range(global_vocab_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """[first, last) vocabulary ids held by one tensor-parallel rank."""
    per_partition = divide(
        global_vocab_size, world_size, "vocabulary size", "tensor_model_parallel_size"
    )
    return rank * per_partition, (rank + 1) * per_partition


def split_tensor_along_last_dim(
    tensor: torch.Tensor, num_partitions: int, contiguous: bool = False
):
    """Split into `num_partitions` equal pieces along the last dimension."""
    size = divide(tensor.size(-1), num_partitions, "last dimension", "number of partitions")
    chunks = torch.split(tensor, size, dim=-1)
    return tuple(c.contiguous() for c in chunks) if contiguous else chunks


def set_tensor_model_parallel_attributes(
    param: torch.Tensor, is_parallel: bool, dim: int, stride: int = 1
) -> None:
    param.tensor_model_parallel = is_parallel
    param.partition_dim = dim
    param.partition_stride = stride


def param_is_not_tensor_parallel_duplicate(param: torch.Tensor) -> bool:
    """True for shards, and for replicated parameters on TP rank 0 only (so each counts once)."""
    if getattr(param, "tensor_model_parallel", False):
        return True
    return parallel_state.get_tensor_model_parallel_rank() == 0


def shard_of(
    full: torch.Tensor, dim: int, rank: int, world_size: int, stride: int = 1
) -> torch.Tensor:
    """The part of `full` that TP rank `rank` holds when split along `dim`.

    With stride s the dimension is seen as s interleaved blocks (e.g. [q; k; v]
    stacked) and each rank takes its slice of every block.
    """
    per_stride = divide(
        full.size(dim), world_size * stride, f"dimension {dim} of the weight", "tp x stride"
    )
    pieces = torch.split(full, per_stride, dim=dim)
    return torch.cat(pieces[rank::world_size], dim=dim)


def unshard(shards: list[torch.Tensor], dim: int, stride: int = 1) -> torch.Tensor:
    """Inverse of `shard_of`: the full tensor from every rank's shard, in TP rank order."""
    world_size = len(shards)
    blocks = [torch.chunk(s, stride, dim=dim) for s in shards]
    return torch.cat([blocks[r][i] for i in range(stride) for r in range(world_size)], dim=dim)
