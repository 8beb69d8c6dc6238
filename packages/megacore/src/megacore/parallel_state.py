"""Process groups for tensor, pipeline and data parallelism, with Megatron-LM's names.

The rank layout is Megatron's: a global rank r has coordinates

    tensor rank   = r % tp                 (TP ranks are adjacent: they talk most)
    data rank     = (r // tp) % dp
    pipeline rank = r // (tp * dp)         (PP outermost: it talks least)

so with 16 ranks, tp=2 and pp=4 the groups are TP [0,1],[2,3]...; DP [0,2],[1,3],
[4,6]...; PP [0,4,8,12],[1,5,9,13]...; model-parallel (TP x PP of one replica)
[0,1,4,5,8,9,12,13],[2,3,6,7,...]; the embedding group of each pipeline is its
first and last stage.  `parallel_groups` computes this layout without any
process group, so it can be inspected (and tested) for any world size.

`initialize_model_parallel` checks its arguments on every rank before it
creates a single group, so a bad size raises the same error everywhere instead
of leaving some ranks waiting in a collective.  Getters called before it raise
an error naming the getter.
"""

import datetime
from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class ParallelGroups:
    """Every group of every kind, as lists of global ranks, for one layout."""

    tensor: list[list[int]]
    pipeline: list[list[int]]
    data: list[list[int]]
    model: list[list[int]]
    embedding: list[list[int]]


@dataclass
class _State:
    tp_group: dist.ProcessGroup
    pp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    mp_group: dist.ProcessGroup
    embedding_group: dist.ProcessGroup | None  # None on ranks that hold no embedding copy
    tp_ranks: list[int]
    pp_ranks: list[int]
    dp_ranks: list[int]
    embedding_ranks: list[int]
    virtual_pipeline_world_size: int | None
    virtual_pipeline_rank: int | None


_STATE: _State | None = None


def _check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"initialize_model_parallel: {name} must be an integer >= 1, got {value!r}"
        )


def parallel_groups(
    world_size: int, tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1
) -> ParallelGroups:
    """The groups `initialize_model_parallel` creates for this layout (no communication)."""
    _check_positive_int("world size", world_size)
    _check_positive_int("tensor_model_parallel_size", tensor_model_parallel_size)
    _check_positive_int("pipeline_model_parallel_size", pipeline_model_parallel_size)
    tp, pp = tensor_model_parallel_size, pipeline_model_parallel_size
    if world_size % (tp * pp):
        raise ValueError(
            f"initialize_model_parallel: world size {world_size} is not divisible by "
            f"tensor_model_parallel_size ({tp}) x pipeline_model_parallel_size ({pp}) = {tp * pp}; "
            f"choose sizes whose product divides {world_size}"
        )
    dp = world_size // (tp * pp)
    ranks_per_stage = tp * dp
    tensor = [list(range(start, start + tp)) for start in range(0, world_size, tp)]
    pipeline = [list(range(i, world_size, ranks_per_stage)) for i in range(ranks_per_stage)]
    data = [
        list(range(stage * ranks_per_stage + t, (stage + 1) * ranks_per_stage, tp))
        for stage in range(pp)
        for t in range(tp)
    ]
    model = [[group[d] for group in data] for d in range(dp)]
    embedding = [[g[0], g[-1]] if len(g) > 1 else list(g) for g in pipeline]
    return ParallelGroups(tensor, pipeline, data, model, embedding)


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    timeout: datetime.timedelta | None = None,
) -> None:
    """Create the TP, PP, DP, model-parallel and embedding groups on the default process group.

    Every rank must call it with the same sizes; data-parallel size is what is left:
    world_size // (tp * pp).  `timeout`: how long a collective on these groups waits for
    the others (None: torch's default, which is not the default group's own).
    """
    global _STATE
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "initialize_model_parallel: torch.distributed is not initialized; "
            "call torch.distributed.init_process_group(...) first"
        )
    if _STATE is not None:
        raise RuntimeError(
            "initialize_model_parallel: model parallel groups are already initialized; "
            "call destroy_model_parallel() first"
        )
    world_size, rank = dist.get_world_size(), dist.get_rank()
    groups = parallel_groups(world_size, tensor_model_parallel_size, pipeline_model_parallel_size)
    vpp = virtual_pipeline_model_parallel_size
    if vpp is not None:
        _check_positive_int("virtual_pipeline_model_parallel_size", vpp)
        if vpp > 1 and pipeline_model_parallel_size == 1:
            raise ValueError(
                f"initialize_model_parallel: virtual_pipeline_model_parallel_size={vpp} needs "
                "pipeline_model_parallel_size > 1 (interleaving splits each pipeline stage)"
            )

    # Every rank creates every group, in the same order: torch.distributed requires it.
    def create(kind: str) -> tuple[dist.ProcessGroup | None, list[int]]:
        mine, my_ranks = None, []
        for ranks in getattr(groups, kind):
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                mine, my_ranks = group, ranks
        return mine, my_ranks

    dp_group, dp_ranks = create("data")
    mp_group, _ = create("model")
    tp_group, tp_ranks = create("tensor")
    pp_group, pp_ranks = create("pipeline")
    embedding_group, _ = create("embedding")
    embedding_ranks = groups.embedding[groups.pipeline.index(pp_ranks)]
    _STATE = _State(
        tp_group=tp_group,
        pp_group=pp_group,
        dp_group=dp_group,
        mp_group=mp_group,
        embedding_group=embedding_group,
        tp_ranks=tp_ranks,
        pp_ranks=pp_ranks,
        dp_ranks=dp_ranks,
        embedding_ranks=embedding_ranks,
        virtual_pipeline_world_size=vpp,
        virtual_pipeline_rank=0 if vpp is not None else None,
    )


def model_parallel_is_initialized() -> bool:
    return _STATE is not None


def destroy_model_parallel() -> None:
    """Forget the groups (they are not destroyed: torch keeps subgroups until the default one)."""
    global _STATE
    _STATE = None


def _state(getter: str) -> _State:
    if _STATE is None:
        raise RuntimeError(
            f"megacore.parallel_state.{getter}() called before model parallel groups exist; "
            "call megacore.parallel_state.initialize_model_parallel(...) first"
        )
    return _STATE


# --- tensor model parallel ---------------------------------------------------------------------


def get_tensor_model_parallel_group() -> dist.ProcessGroup:
    return _state("get_tensor_model_parallel_group").tp_group


def get_tensor_model_parallel_world_size() -> int:
    return len(_state("get_tensor_model_parallel_world_size").tp_ranks)


def get_tensor_model_parallel_rank() -> int:
    return _state("get_tensor_model_parallel_rank").tp_ranks.index(dist.get_rank())


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of TP rank 0 in the caller's TP group (the source of TP broadcasts)."""
    return _state("get_tensor_model_parallel_src_rank").tp_ranks[0]


def get_tensor_model_parallel_ranks() -> list[int]:
    return list(_state("get_tensor_model_parallel_ranks").tp_ranks)


# --- pipeline model parallel -------------------------------------------------------------------


def get_pipeline_model_parallel_group() -> dist.ProcessGroup:
    return _state("get_pipeline_model_parallel_group").pp_group


def get_pipeline_model_parallel_world_size() -> int:
    return len(_state("get_pipeline_model_parallel_world_size").pp_ranks)


def get_pipeline_model_parallel_rank() -> int:
    return _state("get_pipeline_model_parallel_rank").pp_ranks.index(dist.get_rank())


def get_pipeline_model_parallel_first_rank() -> int:
    return _state("get_pipeline_model_parallel_first_rank").pp_ranks[0]


def get_pipeline_model_parallel_last_rank() -> int:
    return _state("get_pipeline_model_parallel_last_rank").pp_ranks[-1]


def get_pipeline_model_parallel_next_rank() -> int:
    """Global rank of the next stage (wrapping around, as Megatron's does)."""
    ranks = _state("get_pipeline_model_parallel_next_rank").pp_ranks
    return ranks[(ranks.index(dist.get_rank()) + 1) % len(ranks)]


def get_pipeline_model_parallel_prev_rank() -> int:
    """Global rank of the previous stage (wrapping around, as Megatron's does)."""
    ranks = _state("get_pipeline_model_parallel_prev_rank").pp_ranks
    return ranks[(ranks.index(dist.get_rank()) - 1) % len(ranks)]


def get_virtual_pipeline_model_parallel_world_size() -> int | None:
    return _state("get_virtual_pipeline_model_parallel_world_size").virtual_pipeline_world_size


def get_virtual_pipeline_model_parallel_rank() -> int | None:
    return _state("get_virtual_pipeline_model_parallel_rank").virtual_pipeline_rank


def set_virtual_pipeline_model_parallel_rank(rank: int) -> None:
    """Which model chunk the interleaved schedule is running now (drives first/last stage)."""
    _state("set_virtual_pipeline_model_parallel_rank").virtual_pipeline_rank = rank


def is_pipeline_first_stage(ignore_virtual: bool = False) -> bool:
    """True on the first stage; with virtual stages, only while running the first chunk."""
    state = _state("is_pipeline_first_stage")
    vpp = state.virtual_pipeline_world_size
    if not ignore_virtual and vpp is not None and state.virtual_pipeline_rank != 0:
        return False
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage(ignore_virtual: bool = False) -> bool:
    """True on the last stage; with virtual stages, only while running the last chunk."""
    state = _state("is_pipeline_last_stage")
    vpp = state.virtual_pipeline_world_size
    if not ignore_virtual and vpp is not None and state.virtual_pipeline_rank != vpp - 1:
        return False
    return get_pipeline_model_parallel_rank() == len(state.pp_ranks) - 1


# --- data parallel, model parallel, embedding --------------------------------------------------


def get_data_parallel_group() -> dist.ProcessGroup:
    return _state("get_data_parallel_group").dp_group


def get_data_parallel_world_size() -> int:
    return len(_state("get_data_parallel_world_size").dp_ranks)


def get_data_parallel_rank() -> int:
    return _state("get_data_parallel_rank").dp_ranks.index(dist.get_rank())


def get_data_parallel_src_rank() -> int:
    return _state("get_data_parallel_src_rank").dp_ranks[0]


def get_model_parallel_group() -> dist.ProcessGroup:
    """TP x PP ranks that hold one replica of the model (for global norms over a model)."""
    return _state("get_model_parallel_group").mp_group


def get_embedding_group() -> dist.ProcessGroup | None:
    """First and last stage of the caller's pipeline (None on a rank in neither)."""
    return _state("get_embedding_group").embedding_group


def get_embedding_global_ranks() -> list[int]:
    return list(_state("get_embedding_global_ranks").embedding_ranks)


def is_rank_in_embedding_group(ignore_virtual: bool = False) -> bool:
    """Whether this rank holds a copy of the word embeddings (first or last stage)."""
    state = _state("is_rank_in_embedding_group")
    if dist.get_rank() not in state.embedding_ranks:
        return False
    if ignore_virtual:
        return True
    return is_pipeline_first_stage() or is_pipeline_last_stage()
