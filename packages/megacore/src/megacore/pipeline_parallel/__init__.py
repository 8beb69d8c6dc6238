"""Pipeline-model parallelism: p2p, schedules, layer assignment, tied embeddings."""

from megacore.pipeline_parallel.layer_assignment import (
    layers_for,
    parse_pipeline_layout,
    stage_layer_counts,
    virtual_stage_layer_counts,
)
from megacore.pipeline_parallel.schedules import (
    SCHEDULES,
    forward_backward_no_pipelining,
    forward_backward_pipelining_with_interleaving,
    forward_backward_pipelining_without_interleaving,
    forward_backward_zero_bubble,
    get_forward_backward_func,
)
from megacore.pipeline_parallel.shared_embeddings import (
    allreduce_shared_embedding_grads,
    finalize_model_grads,
    sync_shared_embeddings,
)
from megacore.pipeline_parallel.tables import (
    COSTS,
    SPLIT_COSTS,
    Comm,
    Step,
    bubble,
    compute_steps,
    order_1f1b,
    order_interleaved,
    order_zb_h1,
    schedule_1f1b,
    schedule_interleaved,
    schedule_no_pipelining,
    schedule_zb_h1,
    timeline,
)

__all__ = [
    "COSTS",
    "SCHEDULES",
    "SPLIT_COSTS",
    "Comm",
    "Step",
    "allreduce_shared_embedding_grads",
    "bubble",
    "compute_steps",
    "finalize_model_grads",
    "forward_backward_no_pipelining",
    "forward_backward_pipelining_with_interleaving",
    "forward_backward_pipelining_without_interleaving",
    "forward_backward_zero_bubble",
    "get_forward_backward_func",
    "layers_for",
    "order_1f1b",
    "order_interleaved",
    "order_zb_h1",
    "parse_pipeline_layout",
    "schedule_1f1b",
    "schedule_interleaved",
    "schedule_no_pipelining",
    "schedule_zb_h1",
    "stage_layer_counts",
    "sync_shared_embeddings",
    "timeline",
    "virtual_stage_layer_counts",
]
