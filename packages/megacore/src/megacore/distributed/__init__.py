"""Data parallelism over the data-parallel group (issue 5: more to come)."""

from megacore.distributed.data_parallel import DistributedDataParallel

__all__ = ["DistributedDataParallel"]
