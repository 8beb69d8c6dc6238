"""Pipeline-model parallelism: p2p, schedules, layer assignment, tied embeddings."""

from megacore.pipeline_parallel.layer_assignment import layers_for, stage_layer_counts
from megacore.pipeline_parallel.schedules import (
    Comm,
    Step,
    compute_steps,
    forward_backward_no_pipelining,
    forward_backward_pipelining_with_interleaving,
    forward_backward_pipelining_without_interleaving,
    get_forward_backward_func,
    schedule_1f1b,
    schedule_interleaved,
    schedule_no_pipelining,
)
from megacore.pipeline_parallel.shared_embeddings import (
    allreduce_shared_embedding_grads,
    finalize_model_grads,
    sync_shared_embeddings,
)

__all__ = [
    "Comm",
    "Step",
    "allreduce_shared_embedding_grads",
    "compute_steps",
    "finalize_model_grads",
    "forward_backward_no_pipelining",
    "forward_backward_pipelining_with_interleaving",
    "forward_backward_pipelining_without_interleaving",
    "get_forward_backward_func",
    "layers_for",
    "schedule_1f1b",
    "schedule_interleaved",
    "schedule_no_pipelining",
    "stage_layer_counts",
    "sync_shared_embeddings",
]
