"""Data parallelism over the data-parallel group: contiguous gradient buckets, ZeRO-1 layout."""

from megacore.distributed.data_parallel import (
    Bucket,
    DistributedDataParallel,
    GradBuffer,
    ShardRange,
)

__all__ = ["Bucket", "DistributedDataParallel", "GradBuffer", "ShardRange"]
