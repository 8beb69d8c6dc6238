"""Context parallelism on built chunks: every layer's attention over the whole sequence while each
CP rank holds two chunks of it (megacore.context_parallel), and the batch split to match."""

from dataclasses import dataclass
from functools import lru_cache

import torch

from megacore import parallel_state
from megacore.context_parallel import cp_chunk_indices, split_for_context_parallel


@dataclass(frozen=True)
class ContextParallel:
    """A chunk's context parallelism (`apply_context_parallel`): this rank's place in the CP
    group and how attention talks to the other ranks ("p2p" ring, "allgather", or multi-latent
    attention's "latent")."""

    rank: int
    size: int
    comm_type: str
    group: object = None  # the CP process group (None: megacore's)

    def positions(self, local_len: int, device) -> torch.Tensor:
        """Global sequence positions of this rank's `local_len` tokens (made once per length
        and device: every layer of every microbatch asks)."""
        return _cp_positions(local_len, self.rank, self.size, torch.device(device))

    def gathered_positions(self, local_len: int, device) -> torch.Tensor:
        """Global positions of every rank's `local_len` tokens in the order an all-gather over
        the CP group lays them out (rank 0's chunks, then rank 1's, ...)."""
        return _cp_gathered_positions(local_len, self.size, torch.device(device))


@lru_cache(maxsize=16)
def _cp_positions(local_len: int, rank: int, size: int, device: torch.device) -> torch.Tensor:
    return cp_chunk_indices(local_len * size, rank, size).to(device)


@lru_cache(maxsize=16)
def _cp_gathered_positions(local_len: int, size: int, device: torch.device) -> torch.Tensor:
    ranks = [cp_chunk_indices(local_len * size, r, size) for r in range(size)]
    return torch.cat(ranks).to(device)


def apply_context_parallel(chunk, comm_type: str, cp: ContextParallel | None = None):
    """Context parallelism on a built chunk, in place; returns it.  Each sequence arrives
    split over the CP ranks (`split_batch_for_context_parallel`); every layer's attention
    then attends over the whole sequence through megacore.context_parallel, and positions
    are the global ones.  Everything else in the model is per token and runs unchanged."""
    if cp is None:
        cp = ContextParallel(
            parallel_state.get_context_parallel_rank(),
            parallel_state.get_context_parallel_world_size(),
            comm_type,
            parallel_state.get_context_parallel_group(),
        )
    if cp.size == 1:
        return chunk
    chunk.context_parallel = cp
    for layer in chunk.transformer_layers():
        layer.attention.context_parallel = cp
    return chunk


def split_batch_for_context_parallel(batch: dict, rank: int, size: int) -> dict:
    """This CP rank's part of a GPT microbatch: chunks r and 2cp-1-r of every [b, s] array
    (tokens, labels, positions, documents, loss mask), the positions made global first."""
    if size == 1:
        return batch
    batch = dict(batch)
    if "position_ids" not in batch:
        b, s = batch["tokens"].shape
        batch["position_ids"] = torch.arange(s, device=batch["tokens"].device).expand(b, s)
    return {k: split_for_context_parallel(v, 1, rank, size) for k, v in batch.items()}
