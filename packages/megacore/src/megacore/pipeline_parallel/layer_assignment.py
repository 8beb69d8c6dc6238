"""Which transformer layers each pipeline stage and virtual chunk builds.

Layers go to virtual stages in order; virtual stage c * pp + r is chunk c of
pipeline rank r.  With 16 layers, pp=4 and vpp=2 each chunk has 2 layers and
rank 0 holds layers 0-1 and 8-9 (1-2 and 9-10 counting from one).  A split
that does not divide evenly is refused unless the first and/or last stage's
layer counts are given (the embedding and the loss make those stages heavier).
"""


def stage_layer_counts(
    num_layers: int,
    pipeline_model_parallel_size: int,
    virtual_pipeline_model_parallel_size: int | None = None,
    num_layers_in_first_pipeline_stage: int | None = None,
    num_layers_in_last_pipeline_stage: int | None = None,
) -> list[int]:
    """Layers per pipeline rank, checked against the pp x vpp split."""
    pp, vpp = pipeline_model_parallel_size, virtual_pipeline_model_parallel_size or 1
    first, last = num_layers_in_first_pipeline_stage, num_layers_in_last_pipeline_stage
    if first is None and last is None:
        if num_layers % (pp * vpp):
            raise ValueError(
                f"num_layers ({num_layers}) is not divisible by pipeline_model_parallel_size x "
                f"virtual_pipeline_model_parallel_size ({pp} x {vpp} = {pp * vpp}); change them "
                "or set num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage"
            )
        return [num_layers // pp] * pp
    if pp == 1:
        raise ValueError(
            "num_layers_in_first/last_pipeline_stage need pipeline_model_parallel_size > 1"
        )
    fixed = {0: first, pp - 1: last}
    fixed = {r: n for r, n in fixed.items() if n is not None}
    rest = num_layers - sum(fixed.values())
    free = pp - len(fixed)
    if rest < 0 or (free == 0 and rest != 0) or (free and rest % free):
        raise ValueError(
            f"num_layers ({num_layers}) minus the first/last stage layers ({sum(fixed.values())}) "
            f"cannot be split evenly over the other {free} pipeline stages"
        )
    counts = [fixed.get(r, rest // free if free else 0) for r in range(pp)]
    for r, n in enumerate(counts):
        if n < 1 or n % vpp:
            raise ValueError(
                f"pipeline stage {r} would get {n} layers, which is not a positive multiple of "
                f"virtual_pipeline_model_parallel_size ({vpp})"
            )
    return counts


def layers_for(
    num_layers: int,
    pipeline_rank: int,
    pipeline_model_parallel_size: int,
    virtual_pipeline_model_parallel_size: int | None = None,
    virtual_rank: int = 0,
    num_layers_in_first_pipeline_stage: int | None = None,
    num_layers_in_last_pipeline_stage: int | None = None,
) -> list[int]:
    """Global layer indices (from 0) of one chunk of one pipeline rank."""
    counts = stage_layer_counts(
        num_layers,
        pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size,
        num_layers_in_first_pipeline_stage,
        num_layers_in_last_pipeline_stage,
    )
    vpp = virtual_pipeline_model_parallel_size or 1
    if not 0 <= virtual_rank < vpp:
        raise ValueError(f"virtual_rank {virtual_rank} is outside [0, {vpp})")
    per_chunk = [n // vpp for n in counts]
    # Virtual stages in model order: (chunk 0, rank 0..pp-1), (chunk 1, rank 0..pp-1), ...
    offset = virtual_rank * sum(per_chunk) + sum(per_chunk[:pipeline_rank])
    return list(range(offset, offset + per_chunk[pipeline_rank]))
