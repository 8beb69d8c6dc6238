"""Process groups for tensor, context, data and pipeline parallelism, with Megatron's names.

The rank layout is megatron-core's tp-cp-dp-pp: a global rank r has coordinates

    tensor rank   = r % tp                       (TP ranks are adjacent: they talk most)
    context rank  = (r // tp) % cp
    data rank     = (r // (tp * cp)) % dp
    pipeline rank = r // (tp * cp * dp)          (PP outermost: it talks least)

so with 16 ranks, tp=2 and pp=4 (cp=1) the groups are TP [0,1],[2,3]...; DP [0,2],[1,3],
[4,6]...; PP [0,4,8,12],[1,5,9,13]...; model-parallel (TP x PP of one replica)
[0,1,4,5,8,9,12,13],[2,3,6,7,...]; the embedding group of each pipeline is its
first and last stage.  With context parallelism (cp > 1) a long sequence is split over
the CP ranks (see megacore.context_parallel): with 8 ranks, tp=2, cp=2 (dp=2) the CP
groups are [0,2],[1,3],[4,6],[5,7]; DP [0,4],[1,5],[2,6],[3,7]; DP x CP (over which
gradients are reduced: every CP rank holds the whole model and sees other tokens)
[0,2,4,6],[1,3,5,7]; TP x CP [0,1,2,3],[4,5,6,7].  The model-parallel group is one per
(dp, cp) coordinate.  With cp=1 every group is what it is without context parallelism.
`parallel_groups` computes this layout without any process group, so it can be
inspected (and tested) for any world size.

The expert layers (mixture of experts) have a layout of their own over the same world and
the same pipeline groups, megatron-core's "parallel folding": expert tensor parallel (etp),
expert parallel (ep) and expert data parallel (edp = world // (etp * ep * pp)), ordered
etp-ep-edp-pp, so

    expert tensor rank = r % etp
    expert rank        = (r // etp) % ep
    expert data rank   = (r // (etp * ep)) % edp
    pipeline rank      = r // (etp * ep * edp)   (the dense layout's: pp is outermost in both)

With 8 ranks, tp 2, ep 4 (etp = tp = 2, edp 1) the expert groups are ETP [0,1],[2,3],...;
EP [0,2,4,6],[1,3,5,7]; ETP x EP [0..7]; with tp 2, ep 2, etp 1 on 4 ranks: EP [0,1],[2,3]
(the experts split over the dense TP ranks), EDP [0,2],[1,3].  The expert data-parallel
group is what expert gradients are reduced over; ETP x EP x PP is what their norm sums over.

`initialize_model_parallel` checks its arguments on every rank before it
creates a single group, so a bad size raises the same error everywhere instead
of leaving some ranks waiting in a collective.  Getters called before it raise
an error naming the getter.
"""

import datetime
from dataclasses import dataclass
from functools import partial

import torch.distributed as dist


@dataclass(frozen=True)
class ParallelGroups:
    """Every group of every kind, as lists of global ranks, for one layout.

    Each kind's groups are ordered by their lowest rank, each group's ranks ascending
    (so a rank's index in its group is its coordinate along that kind).
    `data_with_context` (DP x CP, what gradients are reduced over) and
    `tensor_and_context` (TP x CP) join two kinds; with cp=1 they equal `data` and
    `tensor`.
    """

    tensor: list[list[int]]
    pipeline: list[list[int]]
    data: list[list[int]]
    model: list[list[int]]
    embedding: list[list[int]]
    context: list[list[int]]
    data_with_context: list[list[int]]
    tensor_and_context: list[list[int]]
    tensor_and_data: list[list[int]]
    tensor_and_data_with_context: list[list[int]]
    expert_tensor: list[list[int]]
    expert_model: list[list[int]]
    expert_data: list[list[int]]
    expert_tensor_and_model: list[list[int]]
    expert_tensor_model_pipeline: list[list[int]]


@dataclass
class _State:
    tp_group: dist.ProcessGroup
    pp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    mp_group: dist.ProcessGroup
    cp_group: dist.ProcessGroup
    dp_cp_group: dist.ProcessGroup
    tp_cp_group: dist.ProcessGroup
    embedding_group: dist.ProcessGroup | None  # None on ranks that hold no embedding copy
    tp_ranks: list[int]
    pp_ranks: list[int]
    dp_ranks: list[int]
    cp_ranks: list[int]
    dp_cp_ranks: list[int]
    tp_cp_ranks: list[int]
    embedding_ranks: list[int]
    tp_dp_group: dist.ProcessGroup
    tp_dp_cp_group: dist.ProcessGroup
    etp_group: dist.ProcessGroup
    ep_group: dist.ProcessGroup
    edp_group: dist.ProcessGroup
    etp_ep_group: dist.ProcessGroup
    etp_ep_pp_group: dist.ProcessGroup
    etp_ranks: list[int]
    ep_ranks: list[int]
    edp_ranks: list[int]
    etp_ep_ranks: list[int]
    etp_ep_pp_ranks: list[int]
    virtual_pipeline_world_size: int | None
    virtual_pipeline_rank: int | None


_STATE: _State | None = None


def _check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"initialize_model_parallel: {name} must be an integer >= 1, got {value!r}"
        )


def _grouped(world_size: int, sizes: dict[str, int], varying: str) -> list[list[int]]:
    """Ranks that agree on every coordinate but those named in `varying` (`sizes`: each
    axis's size, innermost first)."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for r in range(world_size):
        coords, rest = {}, r
        for axis, size in sizes.items():
            rest, coords[axis] = divmod(rest, size)
        key = tuple(c for axis, c in coords.items() if axis not in varying)
        groups.setdefault(key, []).append(r)  # in rank order: sorted, and by lowest rank
    return list(groups.values())


def parallel_groups(
    world_size: int,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    context_parallel_size: int = 1,
    *,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int | None = None,
) -> ParallelGroups:
    """The groups `initialize_model_parallel` creates for this layout (no communication).

    Ranks are laid out tp-cp-dp-pp (module doc); data-parallel size is what is left:
    world_size // (tp * cp * pp).  The expert layers' groups are laid out etp-ep-edp-pp
    over the same world (expert_tensor_parallel_size None: tp, as megatron-core), expert
    data-parallel size world_size // (etp * ep * pp).
    """
    _check_positive_int("world size", world_size)
    _check_positive_int("tensor_model_parallel_size", tensor_model_parallel_size)
    _check_positive_int("pipeline_model_parallel_size", pipeline_model_parallel_size)
    _check_positive_int("context_parallel_size", context_parallel_size)
    tp, pp, cp = tensor_model_parallel_size, pipeline_model_parallel_size, context_parallel_size
    if world_size % (tp * cp * pp):
        raise ValueError(
            f"initialize_model_parallel: world size {world_size} is not divisible by "
            f"tensor_model_parallel_size ({tp}) x context_parallel_size ({cp}) x "
            f"pipeline_model_parallel_size ({pp}) = {tp * cp * pp}; "
            f"choose sizes whose product divides {world_size}"
        )
    dp = world_size // (tp * cp * pp)
    ep = expert_model_parallel_size
    etp = tp if expert_tensor_parallel_size is None else expert_tensor_parallel_size
    _check_positive_int("expert_model_parallel_size", ep)
    _check_positive_int("expert_tensor_parallel_size", etp)
    if world_size % (etp * ep * pp):
        raise ValueError(
            f"initialize_model_parallel: world size {world_size} is not divisible by "
            f"expert_tensor_parallel_size ({etp}) x expert_model_parallel_size ({ep}) x "
            f"pipeline_model_parallel_size ({pp}) = {etp * ep * pp}; "
            f"choose expert sizes whose product with pp divides {world_size}"
        )
    edp = world_size // (etp * ep * pp)
    sizes = {"t": tp, "c": cp, "d": dp, "p": pp}  # innermost first
    expert_sizes = {"t": etp, "e": ep, "d": edp, "p": pp}
    grouped = partial(_grouped, world_size, sizes)
    expert = partial(_grouped, world_size, expert_sizes)

    pipeline = grouped("p")
    # Parallel folding keeps the pipeline: both layouts have pp outermost, so pp groups agree.
    assert expert("p") == pipeline
    embedding = [[g[0], g[-1]] if len(g) > 1 else list(g) for g in pipeline]
    return ParallelGroups(
        tensor=grouped("t"),
        pipeline=pipeline,
        data=grouped("d"),
        model=grouped("tp"),
        embedding=embedding,
        context=grouped("c"),
        data_with_context=grouped("cd"),
        tensor_and_context=grouped("tc"),
        tensor_and_data=grouped("td"),
        tensor_and_data_with_context=grouped("tcd"),
        expert_tensor=expert("t"),
        expert_model=expert("e"),
        expert_data=expert("d"),
        expert_tensor_and_model=expert("te"),
        expert_tensor_model_pipeline=expert("tep"),
    )


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    timeout: datetime.timedelta | None = None,
    *,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int | None = None,
) -> None:
    """Create the TP, CP, DP, PP, model-parallel, embedding and joint groups on the default group.

    Every rank must call it with the same sizes; data-parallel size is what is left:
    world_size // (tp * cp * pp).  `context_parallel_size` (megatron-core's name): how
    many ranks split each sequence (megacore.context_parallel); their gradients are
    reduced over `get_data_parallel_group(with_context_parallel=True)`.
    `expert_model_parallel_size` / `expert_tensor_parallel_size` (megatron-core's names; etp
    None: tp): the expert layers' layout over the same world (module doc).  `timeout`: how
    long a collective on these groups waits for the others (None: torch's default, which
    is not the default group's own).
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
    groups = parallel_groups(
        world_size,
        tensor_model_parallel_size,
        pipeline_model_parallel_size,
        context_parallel_size,
        expert_model_parallel_size=expert_model_parallel_size,
        expert_tensor_parallel_size=expert_tensor_parallel_size,
    )
    vpp = virtual_pipeline_model_parallel_size
    if vpp is not None:
        _check_positive_int("virtual_pipeline_model_parallel_size", vpp)
        if vpp > 1 and pipeline_model_parallel_size == 1:
            raise ValueError(
                f"initialize_model_parallel: virtual_pipeline_model_parallel_size={vpp} needs "
                "pipeline_model_parallel_size > 1 (interleaving splits each pipeline stage)"
            )

    # Every rank creates every group, in the same order: torch.distributed requires it.
    # A rank list met again (DP x CP is DP when cp=1, TP x CP is CP when tp=1) reuses
    # its group: the same decision on every rank, so the order stays the same.
    made: dict[tuple[int, ...], dist.ProcessGroup] = {}

    def create(kind: str) -> tuple[dist.ProcessGroup | None, list[int]]:
        mine, my_ranks = None, []
        for ranks in getattr(groups, kind):
            group = made.get(tuple(ranks))
            if group is None:
                group = made[tuple(ranks)] = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                mine, my_ranks = group, ranks
        return mine, my_ranks

    dp_group, dp_ranks = create("data")
    dp_cp_group, dp_cp_ranks = create("data_with_context")
    cp_group, cp_ranks = create("context")
    mp_group, _ = create("model")
    tp_group, tp_ranks = create("tensor")
    tp_cp_group, tp_cp_ranks = create("tensor_and_context")
    pp_group, pp_ranks = create("pipeline")
    embedding_group, _ = create("embedding")
    tp_dp_group, _ = create("tensor_and_data")
    tp_dp_cp_group, _ = create("tensor_and_data_with_context")
    etp_group, etp_ranks = create("expert_tensor")
    ep_group, ep_ranks = create("expert_model")
    edp_group, edp_ranks = create("expert_data")
    etp_ep_group, etp_ep_ranks = create("expert_tensor_and_model")
    etp_ep_pp_group, etp_ep_pp_ranks = create("expert_tensor_model_pipeline")
    embedding_ranks = groups.embedding[groups.pipeline.index(pp_ranks)]
    _STATE = _State(
        tp_group=tp_group,
        pp_group=pp_group,
        dp_group=dp_group,
        mp_group=mp_group,
        cp_group=cp_group,
        dp_cp_group=dp_cp_group,
        tp_cp_group=tp_cp_group,
        embedding_group=embedding_group,
        tp_ranks=tp_ranks,
        pp_ranks=pp_ranks,
        dp_ranks=dp_ranks,
        cp_ranks=cp_ranks,
        dp_cp_ranks=dp_cp_ranks,
        tp_cp_ranks=tp_cp_ranks,
        embedding_ranks=embedding_ranks,
        tp_dp_group=tp_dp_group,
        tp_dp_cp_group=tp_dp_cp_group,
        etp_group=etp_group,
        ep_group=ep_group,
        edp_group=edp_group,
        etp_ep_group=etp_ep_group,
        etp_ep_pp_group=etp_ep_pp_group,
        etp_ranks=etp_ranks,
        ep_ranks=ep_ranks,
        edp_ranks=edp_ranks,
        etp_ep_ranks=etp_ep_ranks,
        etp_ep_pp_ranks=etp_ep_pp_ranks,
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


# --- context parallel --------------------------------------------------------------------------


def get_context_parallel_group() -> dist.ProcessGroup:
    """The ranks that split one sequence (same TP, DP and PP coordinates)."""
    return _state("get_context_parallel_group").cp_group


def get_context_parallel_world_size() -> int:
    return len(_state("get_context_parallel_world_size").cp_ranks)


def get_context_parallel_rank() -> int:
    """Which of the sequence's parts this rank holds (megacore.context_parallel)."""
    return _state("get_context_parallel_rank").cp_ranks.index(dist.get_rank())


def get_context_parallel_global_ranks() -> list[int]:
    return list(_state("get_context_parallel_global_ranks").cp_ranks)


def get_tensor_and_context_parallel_group() -> dist.ProcessGroup:
    """TP x CP ranks of one (dp, pp) coordinate."""
    return _state("get_tensor_and_context_parallel_group").tp_cp_group


def get_tensor_and_context_parallel_world_size() -> int:
    return len(_state("get_tensor_and_context_parallel_world_size").tp_cp_ranks)


def get_tensor_and_context_parallel_rank() -> int:
    ranks = _state("get_tensor_and_context_parallel_rank").tp_cp_ranks
    return ranks.index(dist.get_rank())


# --- data parallel, model parallel, embedding --------------------------------------------------


def get_data_parallel_group(with_context_parallel: bool = False) -> dist.ProcessGroup:
    """The DP group; with_context_parallel: DP x CP, the ranks gradients are reduced over."""
    state = _state("get_data_parallel_group")
    return state.dp_cp_group if with_context_parallel else state.dp_group


def _dp_ranks(getter: str, with_context_parallel: bool) -> list[int]:
    state = _state(getter)
    return state.dp_cp_ranks if with_context_parallel else state.dp_ranks


def get_data_parallel_world_size(with_context_parallel: bool = False) -> int:
    return len(_dp_ranks("get_data_parallel_world_size", with_context_parallel))


def get_data_parallel_rank(with_context_parallel: bool = False) -> int:
    """Rank in the DP group (with_context_parallel: in DP x CP, whose order is tp-cp-dp-pp's)."""
    return _dp_ranks("get_data_parallel_rank", with_context_parallel).index(dist.get_rank())


def get_data_parallel_src_rank(with_context_parallel: bool = False) -> int:
    return _dp_ranks("get_data_parallel_src_rank", with_context_parallel)[0]


def get_tensor_and_data_parallel_group(with_context_parallel: bool = False) -> dist.ProcessGroup:
    """TP x DP (with_context_parallel: TP x DP x CP, every rank of one pipeline stage, which
    together see all of a step's tokens at a layer: expert-bias counts are summed over it)."""
    state = _state("get_tensor_and_data_parallel_group")
    return state.tp_dp_cp_group if with_context_parallel else state.tp_dp_group


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


# --- expert layers (megatron-core's parallel folding: etp-ep-edp-pp) ---------------------------


def _expert(getter: str, field: str) -> tuple[dist.ProcessGroup, list[int]]:
    state = _state(getter)
    return getattr(state, f"{field}_group"), getattr(state, f"{field}_ranks")


def get_expert_model_parallel_group() -> dist.ProcessGroup:
    """The ranks whose experts together make every expert of a layer (tokens go between them)."""
    return _expert("get_expert_model_parallel_group", "ep")[0]


def get_expert_model_parallel_world_size() -> int:
    return len(_expert("get_expert_model_parallel_world_size", "ep")[1])


def get_expert_model_parallel_rank() -> int:
    """Which block of num_experts / ep experts this rank holds."""
    return _expert("get_expert_model_parallel_rank", "ep")[1].index(dist.get_rank())


def get_expert_tensor_parallel_group() -> dist.ProcessGroup:
    """The ranks that split each expert's fc1/fc2 (expert_tensor_parallel_size)."""
    return _expert("get_expert_tensor_parallel_group", "etp")[0]


def get_expert_tensor_parallel_world_size() -> int:
    return len(_expert("get_expert_tensor_parallel_world_size", "etp")[1])


def get_expert_tensor_parallel_rank() -> int:
    return _expert("get_expert_tensor_parallel_rank", "etp")[1].index(dist.get_rank())


def get_expert_data_parallel_group() -> dist.ProcessGroup:
    """The ranks holding the same expert shard: expert gradients are reduced over it."""
    return _expert("get_expert_data_parallel_group", "edp")[0]


def get_expert_data_parallel_world_size() -> int:
    return len(_expert("get_expert_data_parallel_world_size", "edp")[1])


def get_expert_data_parallel_rank() -> int:
    return _expert("get_expert_data_parallel_rank", "edp")[1].index(dist.get_rank())


def get_expert_tensor_and_model_parallel_group() -> dist.ProcessGroup:
    """ETP x EP: the ranks the all-gather dispatcher gathers tokens over."""
    return _expert("get_expert_tensor_and_model_parallel_group", "etp_ep")[0]


def get_expert_tensor_and_model_parallel_world_size() -> int:
    return len(_expert("get_expert_tensor_and_model_parallel_world_size", "etp_ep")[1])


def get_expert_tensor_and_model_parallel_rank() -> int:
    ranks = _expert("get_expert_tensor_and_model_parallel_rank", "etp_ep")[1]
    return ranks.index(dist.get_rank())


def get_expert_tensor_model_pipeline_parallel_group() -> dist.ProcessGroup:
    """ETP x EP x PP: each expert element lives on one of these ranks (the norm sums over it)."""
    return _expert("get_expert_tensor_model_pipeline_parallel_group", "etp_ep_pp")[0]


def expert_layout_is_dense_layout() -> bool:
    """Whether the expert groups are the dense ones (ep 1, etp = tp): expert parameters can
    then be reduced and counted with the dense ones."""
    state = _state("expert_layout_is_dense_layout")
    return len(state.ep_ranks) == 1 and state.etp_ranks == state.tp_ranks
