"""Which transformer layers each pipeline stage and virtual chunk builds.

Layers go to virtual stages in order; virtual stage c * pp + r is chunk c of
pipeline rank r.  With 16 layers, pp=4 and vpp=2 each chunk has 2 layers and
rank 0 holds layers 0-1 and 8-9 (1-2 and 9-10 counting from one).  A split
that does not divide evenly is refused unless the first and/or last stage's
layer counts are given (the embedding and the loss make those stages heavier),
or the layer count of every virtual stage (`stage_layers`, as
`parse_pipeline_layout` reads Megatron-LM's `--pipeline-model-parallel-layout`).
"""

import re
from collections.abc import Sequence

# Megatron-LM's layout letters and Megatron-Bridge's names for them.
LAYOUT_NAMES = {"embedding": "E", "decoder": "t", "mtp": "m", "loss": "L"}
_REPEAT_GROUP = re.compile(r"\(([^()]*)\)\*(\d+)")
_REPEAT_ONE = re.compile(r"([EtmL])\*(\d+)")


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
                " or a pipeline layout"
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


def virtual_stage_layer_counts(
    num_layers: int,
    pipeline_model_parallel_size: int,
    virtual_pipeline_model_parallel_size: int | None = None,
    num_layers_in_first_pipeline_stage: int | None = None,
    num_layers_in_last_pipeline_stage: int | None = None,
    stage_layers: Sequence[int] | None = None,
) -> list[int]:
    """Layers of every virtual stage in model order (chunk c of rank r at c * pp + r).

    `stage_layers` gives them outright (checked: pp x vpp of them, none negative, summing to
    num_layers); otherwise each rank's `stage_layer_counts` share split evenly over its
    chunks."""
    pp, vpp = pipeline_model_parallel_size, virtual_pipeline_model_parallel_size or 1
    if stage_layers is not None:
        if num_layers_in_first_pipeline_stage is not None or (
            num_layers_in_last_pipeline_stage is not None
        ):
            raise ValueError(
                "give either a pipeline layout or num_layers_in_first/last_pipeline_stage, not both"
            )
        counts = list(stage_layers)
        if len(counts) != pp * vpp:
            raise ValueError(
                f"the pipeline layout has {len(counts)} stages; pipeline_model_parallel_size x "
                f"virtual_pipeline_model_parallel_size is {pp} x {vpp} = {pp * vpp}"
            )
        if any(n < 0 for n in counts) or sum(counts) != num_layers:
            raise ValueError(
                f"the pipeline layout's stages hold {sum(counts)} transformer layers "
                f"({counts}); the model has num_layers = {num_layers}"
            )
        return counts
    per_rank = stage_layer_counts(
        num_layers,
        pp,
        virtual_pipeline_model_parallel_size,
        num_layers_in_first_pipeline_stage,
        num_layers_in_last_pipeline_stage,
    )
    return [per_rank[r] // vpp for _ in range(vpp) for r in range(pp)]


def layers_for(
    num_layers: int,
    pipeline_rank: int,
    pipeline_model_parallel_size: int,
    virtual_pipeline_model_parallel_size: int | None = None,
    virtual_rank: int = 0,
    num_layers_in_first_pipeline_stage: int | None = None,
    num_layers_in_last_pipeline_stage: int | None = None,
    stage_layers: Sequence[int] | None = None,
) -> list[int]:
    """Global layer indices (from 0) of one chunk of one pipeline rank."""
    pp = pipeline_model_parallel_size
    vpp = virtual_pipeline_model_parallel_size or 1
    if not 0 <= virtual_rank < vpp:
        raise ValueError(f"virtual_rank {virtual_rank} is outside [0, {vpp})")
    counts = virtual_stage_layer_counts(
        num_layers,
        pp,
        virtual_pipeline_model_parallel_size,
        num_layers_in_first_pipeline_stage,
        num_layers_in_last_pipeline_stage,
        stage_layers,
    )
    stage = virtual_rank * pp + pipeline_rank
    offset = sum(counts[:stage])
    return list(range(offset, offset + counts[stage]))


def _expand(layout: str) -> str:
    text = re.sub(r"[\s,]", "", layout)  # Megatron-LM reads ',' as nothing, for readability
    while True:
        expanded = _REPEAT_ONE.sub(lambda m: m[1] * int(m[2]), text)
        expanded = _REPEAT_GROUP.sub(lambda m: m[1] * int(m[2]), expanded)
        if expanded == text:
            return text
        text = expanded


def parse_pipeline_layout(
    layout: str | Sequence[Sequence[str]],
    pipeline_model_parallel_size: int,
    virtual_pipeline_model_parallel_size: int | None,
    num_layers: int,
    mtp_num_layers: int | None = None,
    name: str = "pipeline_model_parallel_layout",
) -> list[int]:
    """The transformer layers of each virtual stage, from Megatron-LM's layout.

    `layout` is Megatron-LM's string (stages split by '|'; E the embedding, t a transformer
    layer, m a multi-token-prediction depth, L the output layer and loss; `X*n` and
    `(...)*n` repeat; ',' is ignored: "Et*3|(tt|)*29tmL") or Megatron-Bridge's list of
    stages, each a list of "embedding", "decoder", "mtp" and "loss".  The embedding must
    open the first stage, and the MTP depths and the loss close the last (megatrain runs
    the MTP depths beside the loss); a stage may hold no transformer layer.  Every refusal
    names `name` and what was expected.
    """
    pp, vpp = pipeline_model_parallel_size, virtual_pipeline_model_parallel_size or 1
    if isinstance(layout, str):
        text = _expand(layout)
        bad = sorted(set(text) - set("EtmL|"))
        if bad:
            raise ValueError(
                f"{name} = {layout!r}: {''.join(bad)!r} is not a layout letter (E embedding, "
                "t transformer layer, m MTP depth, L loss, '|' between stages, X*n and (...)*n "
                "to repeat)"
            )
        stages = text.split("|")
    else:
        stages = []
        for i, stage in enumerate(layout):
            if not isinstance(stage, (list, tuple)) or any(
                not isinstance(item, str) or item not in LAYOUT_NAMES for item in stage
            ):
                raise ValueError(
                    f"{name}: stage {i} is {stage!r}; each stage is a list of "
                    f"{', '.join(repr(n) for n in LAYOUT_NAMES)}"
                )
            stages.append("".join(LAYOUT_NAMES[item] for item in stage))
    if len(stages) != pp * vpp:
        raise ValueError(
            f"{name} has {len(stages)} stages; parallel.pipeline_model_parallel_size x "
            f"virtual_pipeline_model_parallel_size is {pp} x {vpp} = {pp * vpp}"
        )
    joined = "|".join(stages)
    if joined.count("E") != 1 or not stages[0].startswith("E"):
        raise ValueError(f"{name}: the embedding (E) must open the first stage, once")
    if joined.count("L") != 1 or not stages[-1].endswith("L"):
        raise ValueError(f"{name}: the loss (L) must close the last stage, once")
    mtp = mtp_num_layers or 0
    if joined.count("m") != mtp or not stages[-1].endswith("m" * mtp + "L"):
        raise ValueError(
            f"{name}: the last stage must end with the model's {mtp} MTP depth(s) (m) right "
            f"before the loss (L), {'m' * mtp}L, and no stage elsewhere may hold one "
            "(megatrain computes the MTP depths beside the loss)"
        )
    counts = [stage.count("t") for stage in stages]
    if sum(counts) != num_layers:
        raise ValueError(
            f"{name} holds {sum(counts)} transformer layers (t); model.num_layers is {num_layers}"
        )
    return counts
