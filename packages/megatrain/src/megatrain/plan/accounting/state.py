"""Memory of a model's state, from its config alone: the bytes per parameter of weights,
gradients and optimizer state (`state_bytes_per_parameter`), what FSDP holds unsharded on
top of its shards (`fsdp_gathered_bytes`); `megatrain.plan.memory` adds them up per stage.
Host memory: the copy of a rank's state a background checkpoint save keeps
(`checkpoint_copy_bytes_per_parameter`).
"""


def state_bytes_per_parameter(
    precision: str, distributed_optimizer: bool, dp: int, sharding: str | None = None
) -> dict[str, float]:
    """megacore's optimizer table split by what holds the bytes: the model's weights (2 in
    16 bits, 4 in fp32), the fp32 gradient buffer (4), and the optimizer's state (fp32 master
    weights when the model is 16-bit, Adam's two moments: 12 or 8), sharded over dp by the
    distributed optimizer.

    In all: fp32 16 bytes per parameter (weights and grads 4 each, Adam's two moments 8);
    fp16/bf16 18 (16-bit weights 2, fp32 grads 4, fp32 master and moments 12); under
    `use_distributed_optimizer` 8 + 8/d and 6 + 12/d.

    `sharding` (parallel.data_parallel_sharding; None: "optimizer" or "none" as
    `distributed_optimizer` says): "full" (FSDP2) keeps every parameter once in fp32, sharded,
    the masters themselves (weights 4/d), its fp32 gradient sharded (4/d) and Adam's moments
    (8/d): 16/d in any precision.  What FSDP gathers for compute comes on top
    (`fsdp_gathered_bytes`).
    """
    if sharding == "full":
        return {"weights": 4 / dp, "gradients": 4 / dp, "optimizer_state": 8 / dp}
    optimizer = 8 if precision == "fp32" else 12
    return {
        "weights": 4 if precision == "fp32" else 2,
        "gradients": 4,
        "optimizer_state": optimizer / dp if distributed_optimizer else optimizer,
    }


def fsdp_gathered_bytes(
    params: int,
    layer_params: int,
    layers: int,
    precision: str,
    reshard_after_forward: bool,
    microbatches: int,
    reduce_every_microbatch: bool = False,
    layers_params: int | None = None,
) -> float:
    """Bytes FSDP2 holds unsharded on top of its shards (`data_parallel_sharding = "full"`),
    for a stage of `params` parameters per rank, `layers` layers of `layer_params` each (or,
    where they differ, a MoE model's dense and MoE layers, `layers_params` in all and
    `layer_params` the largest's):

    - gathered parameters in the compute dtype (2 bytes in 16 bits, 4 in fp32): the chunk's
      own (embeddings, output layer: kept from forward to backward) and, with
      `reshard_after_forward`, two layers' (the one computing, the one prefetched), else
      every layer's;
    - gradients: with one microbatch, or with `reduce_every_microbatch`
      (`parallel.reduce_every_microbatch`: each microbatch reduce-scattered into the
      shards), one layer's unsharded gradient and its fp32 reduce-scatter copy; with
      gradient accumulation otherwise every parameter's unsharded fp32 gradient, held from
      the first microbatch's backward to the last one's reduce-scatter.
    """
    compute = 4 if precision == "fp32" else 2
    layers_params = layers * layer_params if layers_params is None else layers_params
    own = params - layers_params
    gathered = own + (min(2, layers) * layer_params if reshard_after_forward else layers_params)
    accumulated = microbatches > 1 and not reduce_every_microbatch
    gradients = 4 * params if accumulated else (compute + 4) * layer_params
    return compute * gathered + gradients


def checkpoint_copy_bytes_per_parameter(
    precision: str, distributed_optimizer: bool, dp: int, sharding: str | None = None
) -> float:
    """Host bytes per parameter of a rank's copy of its state for a background save
    (`checkpoint.async_save`, megatrain.checkpoint.background): what the rank saves, its
    weights in the run's dtype (2 or 4 bytes; under "full" its rows only, / dp) and its
    optimizer state, the fp32 master and Adam's two moments (12 bytes, / dp when sharded)."""
    full = sharding == "full"
    weights = (4 if precision == "fp32" else 2) / (dp if full else 1)
    return weights + 12 / (dp if full or distributed_optimizer else 1)
