"""Process-group layout: Megatron-LM's 16-rank example group for group, others by rule."""

import pytest
import torch
import torch.distributed as dist

from megacore import parallel_state as ps
from megacore.testing import run_distributed

# Megatron-LM's example layout (tp 2, pp 4, 16 ranks), group for group.
EXAMPLE_16_RANKS = {
    "tensor": [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]],
    "pipeline": [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]],
    "data": [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]],
    "model": [[0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15]],
    "embedding": [[0, 12], [1, 13], [2, 14], [3, 15]],
}


def test_megatron_16_rank_example_layout():
    groups = ps.parallel_groups(16, 2, 4)
    for kind, expected in EXAMPLE_16_RANKS.items():
        assert getattr(groups, kind) == expected, kind


def _layouts(max_world):
    for world in range(1, max_world + 1):
        for tp in range(1, world + 1):
            for pp in range(1, world // tp + 1):
                if world % (tp * pp) == 0:
                    yield world, tp, pp


def test_layout_rule_for_every_dividing_size():
    """TP adjacent, DP next, PP outermost, derived here from coordinates independently."""
    count = 0
    for world, tp, pp in _layouts(24):
        dp = world // (tp * pp)
        g = ps.parallel_groups(world, tp, pp)

        def coords(r, tp=tp, dp=dp):
            return r % tp, (r // tp) % dp, r // (tp * dp)  # (tp rank, dp rank, pp rank)

        def grouped_by(*fixed, world=world, coords=coords):
            """Groups of ranks that agree on the `fixed` coordinates, each sorted by rank."""
            out = {}
            for r in range(world):
                out.setdefault(tuple(coords(r)[i] for i in fixed), []).append(r)
            return sorted(out.values())

        assert sorted(g.tensor) == grouped_by(1, 2)
        assert sorted(g.data) == grouped_by(0, 2)
        assert sorted(g.pipeline) == grouped_by(0, 1)
        assert sorted(g.model) == grouped_by(1)
        assert all(coords(r)[0] == i for grp in g.tensor for i, r in enumerate(grp))
        assert all(coords(r)[2] == i for grp in g.pipeline for i, r in enumerate(grp))
        expected_embedding = [[p[0], p[-1]] if pp > 1 else p for p in g.pipeline]
        assert g.embedding == expected_embedding
        count += 1
    assert count > 100


@pytest.mark.parametrize(
    ("world", "tp", "pp", "words"),
    [
        (16, 3, 1, ["16", "tensor_model_parallel_size (3)", "= 3"]),
        (16, 4, 8, ["16", "(4)", "(8)", "= 32"]),
        (8, 0, 1, ["tensor_model_parallel_size", "got 0"]),
        (8, 2, -1, ["pipeline_model_parallel_size", "got -1"]),
    ],
)
def test_bad_sizes_named(world, tp, pp, words):
    with pytest.raises(ValueError, match="initialize_model_parallel") as err:
        ps.parallel_groups(world, tp, pp)
    for word in words:
        assert word in str(err.value)


def _error_of(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except (ValueError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def _ranks(group):
    return dist.get_process_group_ranks(group) if group is not None else None


def _check_groups_on_16_ranks():
    rank = dist.get_rank()
    out = {
        "before_init": _error_of(ps.get_tensor_model_parallel_group),
        "before_init_rank": _error_of(ps.is_pipeline_first_stage),
        "bad_tp": _error_of(ps.initialize_model_parallel, 3, 1),
        "bad_product": _error_of(ps.initialize_model_parallel, 4, 8),
        "bad_vpp": _error_of(ps.initialize_model_parallel, 2, 1, 2),
        "initialized_after_errors": ps.model_parallel_is_initialized(),
    }
    ps.initialize_model_parallel(2, 4)
    out["again"] = _error_of(ps.initialize_model_parallel, 2, 4)
    groups = {
        "tensor": ps.get_tensor_model_parallel_group(),
        "pipeline": ps.get_pipeline_model_parallel_group(),
        "data": ps.get_data_parallel_group(),
        "model": ps.get_model_parallel_group(),
        "embedding": ps.get_embedding_group(),
    }
    out["groups"] = {kind: _ranks(g) for kind, g in groups.items()}
    # Each group works: the sum of global ranks over it is the sum of its members.
    out["sums"] = {}
    for kind, g in groups.items():
        if g is not None:
            t = torch.tensor([float(rank)])
            dist.all_reduce(t, group=g)
            out["sums"][kind] = t.item()
    out.update(
        tp=(ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()),
        pp=(ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()),
        dp=(ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()),
        next=ps.get_pipeline_model_parallel_next_rank(),
        prev=ps.get_pipeline_model_parallel_prev_rank(),
        tp_src=ps.get_tensor_model_parallel_src_rank(),
        first=ps.is_pipeline_first_stage(),
        last=ps.is_pipeline_last_stage(),
        in_embedding=ps.is_rank_in_embedding_group(),
    )
    ps.destroy_model_parallel()
    out["after_destroy"] = _error_of(ps.get_data_parallel_rank)

    # Interleaving: first/last stage follow the virtual rank being run.
    ps.initialize_model_parallel(1, 4, virtual_pipeline_model_parallel_size=2)
    virtual = []
    for v in range(2):
        ps.set_virtual_pipeline_model_parallel_rank(v)
        virtual.append(
            (
                ps.is_pipeline_first_stage(),
                ps.is_pipeline_last_stage(),
                ps.is_pipeline_first_stage(ignore_virtual=True),
                ps.is_pipeline_last_stage(ignore_virtual=True),
            )
        )
    out["virtual"] = virtual
    out["vpp_size"] = ps.get_virtual_pipeline_model_parallel_world_size()
    ps.destroy_model_parallel()
    return out


def _group_of(kind, rank):
    return next(g for g in EXAMPLE_16_RANKS[kind] if rank in g)


def test_groups_on_16_gloo_ranks():
    results = run_distributed(_check_groups_on_16_ranks, world_size=16, timeout=300)
    for rank, out in enumerate(results):
        assert "get_tensor_model_parallel_group() called before" in out["before_init"]
        assert "initialize_model_parallel(...) first" in out["before_init"]
        assert "is_pipeline_first_stage() called before" in out["before_init_rank"]
        assert "world size 16 is not divisible" in out["bad_tp"]
        assert "= 32" in out["bad_product"]
        assert "virtual_pipeline_model_parallel_size=2" in out["bad_vpp"]
        assert not out["initialized_after_errors"]
        assert "already initialized" in out["again"]
        assert "get_data_parallel_rank() called before" in out["after_destroy"]

        for kind in ("tensor", "pipeline", "data", "model"):
            assert out["groups"][kind] == _group_of(kind, rank), (rank, kind)
            assert out["sums"][kind] == sum(_group_of(kind, rank)), (rank, kind)
        pipeline = _group_of("pipeline", rank)
        stage = pipeline.index(rank)
        in_embedding = stage in (0, 3)
        assert out["groups"]["embedding"] == (
            _group_of("embedding", rank) if in_embedding else None
        )
        assert out["in_embedding"] == in_embedding
        assert out["tp"] == (rank % 2, 2)
        assert out["dp"] == (_group_of("data", rank).index(rank), 2)
        assert out["pp"] == (stage, 4)
        assert out["next"] == pipeline[(stage + 1) % 4]
        assert out["prev"] == pipeline[(stage - 1) % 4]
        assert out["tp_src"] == rank - rank % 2
        assert (out["first"], out["last"]) == (stage == 0, stage == 3)

        # Second layout: tp 1, pp 4, dp 4 with two virtual stages per rank.
        vstage = rank // 4
        assert out["vpp_size"] == 2
        assert out["virtual"] == [
            (vstage == 0, False, vstage == 0, vstage == 3),
            (False, vstage == 3, vstage == 0, vstage == 3),
        ]


# --- context parallelism: megatron-core's tp-cp-dp-pp order ------------------------------------

# 8 ranks, tp 2, cp 2 (so dp 2), written out group for group.
EXAMPLE_8_RANKS_TP2_CP2 = {
    "tensor": [[0, 1], [2, 3], [4, 5], [6, 7]],
    "context": [[0, 2], [1, 3], [4, 6], [5, 7]],
    "data": [[0, 4], [1, 5], [2, 6], [3, 7]],
    "data_with_context": [[0, 2, 4, 6], [1, 3, 5, 7]],
    "tensor_and_context": [[0, 1, 2, 3], [4, 5, 6, 7]],
    "pipeline": [[0], [1], [2], [3], [4], [5], [6], [7]],
    "model": [[0, 1], [2, 3], [4, 5], [6, 7]],
    "embedding": [[0], [1], [2], [3], [4], [5], [6], [7]],
}


def test_tp2_cp2_dp2_example_layout():
    groups = ps.parallel_groups(8, 2, 1, 2)
    for kind, expected in EXAMPLE_8_RANKS_TP2_CP2.items():
        assert getattr(groups, kind) == expected, kind


def test_cp4_examples():
    # cp 4 alone: one sequence over 4 ranks, two data-parallel replicas.
    g = ps.parallel_groups(8, context_parallel_size=4)
    assert g.context == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert g.data == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g.data_with_context == [list(range(8))]
    assert g.tensor_and_context == g.context
    assert g.model == [[r] for r in range(8)]
    # tp 2, cp 4, pp 2 on 16 ranks (dp 1): a pipeline stage is 8 adjacent ranks.
    g = ps.parallel_groups(16, 2, 2, 4)
    assert g.context == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert g.pipeline == [[r, r + 8] for r in range(8)]
    assert g.data == [[r] for r in range(16)]
    assert g.data_with_context == g.context
    assert g.tensor_and_context == [list(range(8)), list(range(8, 16))]
    assert g.model == [[c * 2, c * 2 + 1, c * 2 + 8, c * 2 + 9] for c in range(4)]
    assert g.embedding == g.pipeline


def _cp_layouts(max_world):
    for world in range(1, max_world + 1):
        for tp in range(1, world + 1):
            for cp in range(1, world // tp + 1):
                for pp in range(1, world // (tp * cp) + 1):
                    if world % (tp * cp * pp) == 0:
                        yield world, tp, cp, pp


def test_context_parallel_layout_rule():
    """Every kind partitions the ranks; each group is the ranks agreeing on the other axes."""
    count = 0
    for world, tp, cp, pp in _cp_layouts(16):
        dp = world // (tp * cp * pp)
        g = ps.parallel_groups(world, tp, pp, cp)

        def coords(r, tp=tp, cp=cp, dp=dp):  # (tp, cp, dp, pp) ranks, computed independently
            return r % tp, (r // tp) % cp, (r // (tp * cp)) % dp, r // (tp * cp * dp)

        def grouped_by(*fixed, world=world, coords=coords):
            out = {}
            for r in range(world):
                out.setdefault(tuple(coords(r)[i] for i in fixed), []).append(r)
            return sorted(out.values())

        kinds = {
            "tensor": (1, 2, 3),
            "context": (0, 2, 3),
            "data": (0, 1, 3),
            "pipeline": (0, 1, 2),
            "data_with_context": (0, 3),
            "tensor_and_context": (2, 3),
            "model": (1, 2),  # one replica's TP x PP, per (cp, dp) coordinate
        }
        for kind, fixed in kinds.items():
            groups = getattr(g, kind)
            assert groups == grouped_by(*fixed), (world, tp, cp, pp, kind)
            assert sorted(r for grp in groups for r in grp) == list(range(world)), kind
        # A rank's index in its group is its coordinate along that axis.
        for kind, axis in (("tensor", 0), ("context", 1), ("data", 2), ("pipeline", 3)):
            assert all(
                coords(r)[axis] == i for grp in getattr(g, kind) for i, r in enumerate(grp)
            ), kind
        assert all(len(grp) == dp * cp for grp in g.data_with_context)
        assert g.embedding == [[p[0], p[-1]] if pp > 1 else p for p in g.pipeline]
        if cp == 1:  # nothing changes without context parallelism
            assert g == ps.parallel_groups(world, tp, pp)
            assert g.data_with_context == g.data and g.tensor_and_context == g.tensor
            assert g.context == [[r] for r in range(world)]
        count += 1
    assert count > 100


@pytest.mark.parametrize(
    ("world", "tp", "pp", "cp", "words"),
    [
        (8, 2, 1, 3, ["world size 8", "context_parallel_size (3)", "= 6"]),
        (8, 2, 2, 4, ["(2) x context_parallel_size (4) x", "= 16"]),
        (8, 1, 1, 0, ["context_parallel_size", "got 0"]),
    ],
)
def test_bad_context_parallel_sizes_named(world, tp, pp, cp, words):
    with pytest.raises(ValueError, match="initialize_model_parallel") as err:
        ps.parallel_groups(world, tp, pp, cp)
    for word in words:
        assert word in str(err.value)


def _check_context_parallel_groups_on_8_ranks():
    rank = dist.get_rank()
    out = {
        "before_init": _error_of(ps.get_context_parallel_group),
        "bad_cp": _error_of(ps.initialize_model_parallel, 2, context_parallel_size=3),
        "bad_cp_pp": _error_of(ps.initialize_model_parallel, 2, 2, context_parallel_size=4),
        "initialized_after_errors": ps.model_parallel_is_initialized(),
    }
    ps.initialize_model_parallel(2, context_parallel_size=2)
    groups = {
        "tensor": ps.get_tensor_model_parallel_group(),
        "context": ps.get_context_parallel_group(),
        "data": ps.get_data_parallel_group(),
        "data_with_context": ps.get_data_parallel_group(with_context_parallel=True),
        "tensor_and_context": ps.get_tensor_and_context_parallel_group(),
        "pipeline": ps.get_pipeline_model_parallel_group(),
        "model": ps.get_model_parallel_group(),
        "embedding": ps.get_embedding_group(),
    }
    out["groups"] = {kind: _ranks(g) for kind, g in groups.items()}
    out["sums"] = {}
    for kind, g in groups.items():  # each group works: it sums its members' ranks
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=g)
        out["sums"][kind] = t.item()
    out.update(
        tp=(ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()),
        cp=(ps.get_context_parallel_rank(), ps.get_context_parallel_world_size()),
        cp_ranks=ps.get_context_parallel_global_ranks(),
        dp=(ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()),
        dp_cp=(
            ps.get_data_parallel_rank(with_context_parallel=True),
            ps.get_data_parallel_world_size(with_context_parallel=True),
        ),
        dp_src=(
            ps.get_data_parallel_src_rank(),
            ps.get_data_parallel_src_rank(with_context_parallel=True),
        ),
        tp_cp=(
            ps.get_tensor_and_context_parallel_rank(),
            ps.get_tensor_and_context_parallel_world_size(),
        ),
        pp=(ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()),
    )
    ps.destroy_model_parallel()
    out["after_destroy"] = _error_of(ps.get_context_parallel_rank)
    return out


def test_context_parallel_groups_on_8_gloo_ranks():
    results = run_distributed(_check_context_parallel_groups_on_8_ranks, world_size=8, timeout=300)
    layout = EXAMPLE_8_RANKS_TP2_CP2
    for rank, out in enumerate(results):
        assert "get_context_parallel_group() called before" in out["before_init"]
        assert "world size 8 is not divisible" in out["bad_cp"]
        assert "context_parallel_size (3)" in out["bad_cp"]
        assert "= 16" in out["bad_cp_pp"]
        assert not out["initialized_after_errors"]
        assert "get_context_parallel_rank() called before" in out["after_destroy"]

        def mine(kind, rank=rank):
            return next(g for g in layout[kind] if rank in g)

        for kind in layout:
            assert out["groups"][kind] == mine(kind), (rank, kind)
            assert out["sums"][kind] == sum(mine(kind)), (rank, kind)
        assert out["tp"] == (rank % 2, 2)
        assert out["cp"] == ((rank // 2) % 2, 2)
        assert out["cp_ranks"] == mine("context")
        assert out["dp"] == (rank // 4, 2)
        assert out["dp_cp"] == (mine("data_with_context").index(rank), 4)
        assert out["dp_cp"][0] == (rank // 2) % 2 + 2 * (rank // 4)  # cp rank + cp * dp rank
        assert out["dp_src"] == (rank % 4, rank % 2)
        assert out["tp_cp"] == (rank % 4, 4)
        assert out["pp"] == (0, 1)
