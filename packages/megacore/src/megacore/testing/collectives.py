"""Count the tensor-parallel collectives a piece of model code issues (paper Fig. 4)."""

import contextlib
from collections.abc import Iterator

import torch.distributed as dist

from megacore import parallel_state as ps
from megacore.tensor_parallel import mappings


@contextlib.contextmanager
def count_tp_collectives() -> Iterator[dict[str, int]]:
    """Within the block, count all-reduces, all-gathers and reduce-scatters by kind, and
    how many of them went to a group other than the tensor-parallel one ("wrong_group")."""
    counts = {"all_reduce": 0, "all_gather": 0, "reduce_scatter": 0, "wrong_group": 0}
    tp_group = ps.get_tensor_model_parallel_group()

    def counting(kind, real):
        def call(*args, group=None, **kwargs):
            counts[kind] += 1
            counts["wrong_group"] += group is not tp_group
            return real(*args, group=group, **kwargs)

        return call

    saved = dist.all_reduce, mappings._all_gather_flat, mappings._reduce_scatter_flat
    dist.all_reduce = counting("all_reduce", saved[0])
    mappings._all_gather_flat = counting("all_gather", saved[1])
    mappings._reduce_scatter_flat = counting("reduce_scatter", saved[2])
    try:
        yield counts
    finally:
        dist.all_reduce, mappings._all_gather_flat, mappings._reduce_scatter_flat = saved
