"""Word embeddings tied across the first and last pipeline stage.

The first stage looks tokens up in the word embeddings; the last stage uses the
same matrix as its output layer.  With pp > 1 each keeps its own copy, marked
`param.shared_embedding = True`.  `sync_shared_embeddings` makes the copies
equal once (the first stage's wins), on their final device; after each backward
`allreduce_shared_embedding_grads` sums their gradients over the embedding
group, so both copies take the same step and stay equal, exactly as the one
tied matrix of an unsplit model would.
"""

import torch
import torch.distributed as dist
from torch import nn

from megacore import parallel_state as ps
from megacore.tensor_parallel import sync_sequence_parallel_grads
from megacore.tensor_parallel.layers import local_tensor


def _shared(model_chunks: list[nn.Module]) -> list[nn.Parameter]:
    return [
        p
        for chunk in model_chunks
        for p in chunk.parameters()
        if getattr(p, "shared_embedding", False)
    ]


def _embedding_group_in_use() -> bool:
    return ps.get_pipeline_model_parallel_world_size() > 1 and ps.is_rank_in_embedding_group(
        ignore_virtual=True
    )


def sync_shared_embeddings(model_chunks: list[nn.Module]) -> None:
    """Copy the first stage's word embeddings into the last stage's output copy.

    A collective over the embedding group: call it once the parameters are on their
    final device (NCCL moves CUDA tensors only), as megatrain's `build_gpt_chunks` does
    by building the chunks there.
    """
    if not _embedding_group_in_use():
        return
    group = ps.get_embedding_group()
    src = ps.get_embedding_global_ranks()[0]
    shared = _shared(model_chunks)
    if dist.get_backend(group) == "nccl":
        on_cpu = [tuple(p.shape) for p in shared if p.device.type == "cpu"]
        if on_cpu:  # NCCL would fail later with a far less helpful message
            raise ValueError(
                f"sync_shared_embeddings: tied embedding copies of shape {on_cpu} are on the "
                "CPU, but the embedding group uses NCCL; build the model on its GPU first"
            )
    with torch.no_grad():
        for p in shared:
            dist.broadcast(p.data, src=src, group=group)


def allreduce_shared_embedding_grads(model_chunks: list[nn.Module]) -> None:
    """Sum the tied embedding's gradients over the first and last stage."""
    if not _embedding_group_in_use():
        return
    for p in _shared(model_chunks):
        grad = getattr(p, "main_grad", None)
        grad = p.grad if grad is None else grad
        if grad is None:
            grad = p.grad = torch.zeros_like(p)
        # FSDP2: both copies are sharded alike over DP; the stages sum their local shards.
        dist.all_reduce(local_tensor(grad), group=ps.get_embedding_group())


def finalize_model_grads(model_chunks: list[nn.Module]) -> None:
    """After the last backward: data-parallel, sequence-parallel and tied-embedding sums."""
    for chunk in model_chunks:
        finish = getattr(chunk, "finish_grad_sync", None)  # megacore's DistributedDataParallel
        if finish is not None:
            finish()
        sync_sequence_parallel_grads(chunk)
    allreduce_shared_embedding_grads(model_chunks)
