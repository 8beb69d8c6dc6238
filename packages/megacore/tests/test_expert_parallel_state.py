"""The expert layers' process groups (parallel folding) against megatron-core's RankGenerator.

`_megatron_rank_groups` is megatron-core's `generate_masked_orthogonal_rank_groups`
(NVIDIA/Megatron-LM, megatron/core/parallel_state.py at d98e8a6), copied down to its
arithmetic so the comparison needs no Megatron install; `_megatron_ranks` is its
`RankGenerator.get_ranks` for the default order "tp-cp-ep-dp-pp".
"""

import pytest

from megacore import parallel_state as ps


def _megatron_rank_groups(world_size, parallel_size, mask):
    def prefix_product(a, init=1):
        r = [init]
        for v in a:
            init = init * v
            r.append(init)
        return r

    def inner_product(a, b):
        return sum(x * y for x, y in zip(a, b, strict=False))

    def decompose(index, shape, stride=None):
        if stride is None:
            stride = prefix_product(shape)
        return [(index // d) % s for s, d in zip(shape, stride, strict=False)]

    masked_shape = [s for s, m in zip(parallel_size, mask, strict=True) if m]
    unmasked_shape = [s for s, m in zip(parallel_size, mask, strict=True) if not m]
    global_stride = prefix_product(parallel_size)
    masked_stride = [d for d, m in zip(global_stride, mask, strict=False) if m]
    unmasked_stride = [d for d, m in zip(global_stride, mask, strict=False) if not m]
    group_size = prefix_product(masked_shape)[-1]
    ranks = []
    for group_index in range(world_size // group_size):
        decomposed_group_idx = decompose(group_index, unmasked_shape)
        ranks.append(
            [
                inner_product(decompose(i, masked_shape), masked_stride)
                + inner_product(decomposed_group_idx, unmasked_stride)
                for i in range(group_size)
            ]
        )
    return ranks


def _megatron_ranks(sizes: dict, token: str):
    order = ["tp", "cp", "ep", "dp", "pp"]
    world = 1
    for s in sizes.values():
        world *= s
    mask = [name in token.split("-") for name in order]
    return _megatron_rank_groups(world, [sizes[n] for n in order], mask)


def _layouts():
    """(world, tp, pp, cp, ep, etp) for every size up to 16 ranks that divides."""
    for world in (1, 2, 4, 6, 8, 12, 16):
        for tp in (1, 2, 4):
            for pp in (1, 2, 4):
                for cp in (1, 2):
                    for ep in (1, 2, 3, 4, 8):
                        for etp in (None, 1, 2):
                            e = tp if etp is None else etp
                            if world % (tp * pp * cp) == 0 and world % (e * ep * pp) == 0:
                                yield world, tp, pp, cp, ep, etp


def test_expert_groups_match_megatron_rank_generator():
    count = 0
    for world, tp, pp, cp, ep, etp in _layouts():
        g = ps.parallel_groups(
            world, tp, pp, cp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp
        )
        e = tp if etp is None else etp
        dense = {"tp": tp, "cp": cp, "ep": 1, "dp": world // (tp * cp * pp), "pp": pp}
        expert = {"tp": e, "cp": 1, "ep": ep, "dp": world // (e * ep * pp), "pp": pp}
        layout = (world, tp, pp, cp, ep, etp)
        for kind, token in {
            "tensor": "tp",
            "context": "cp",
            "data": "dp",
            "data_with_context": "cp-dp",
            "tensor_and_context": "tp-cp",
            "tensor_and_data": "tp-dp",
            "tensor_and_data_with_context": "tp-cp-dp",
            "pipeline": "pp",
        }.items():
            assert sorted(getattr(g, kind)) == sorted(_megatron_ranks(dense, token)), (layout, kind)
        for kind, token in {
            "expert_tensor": "tp",
            "expert_model": "ep",
            "expert_data": "dp",
            "expert_tensor_and_model": "tp-ep",
            "expert_tensor_model_pipeline": "tp-ep-pp",
            "pipeline": "pp",  # parallel folding: the same pipelines in both layouts
        }.items():
            # Megatron's groups list ranks in coordinate order, ours ascending: the same here.
            assert sorted(getattr(g, kind)) == sorted(_megatron_ranks(expert, token)), (
                layout,
                kind,
            )
        count += 1
    assert count > 150


def test_expert_examples():
    # tp 2, ep 2, etp 1 on 4 ranks: the two experts' halves on the dense TP pair.
    g = ps.parallel_groups(4, 2, expert_model_parallel_size=2, expert_tensor_parallel_size=1)
    assert g.expert_model == [[0, 1], [2, 3]]
    assert g.expert_data == [[0, 2], [1, 3]]
    assert g.expert_tensor == [[r] for r in range(4)]
    # tp 2 pp 2, ep 2 (etp = tp) on 8 ranks: edp 1, each stage's 4 ranks hold every expert.
    g = ps.parallel_groups(8, 2, 2, expert_model_parallel_size=2)
    assert g.expert_tensor == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g.expert_model == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g.expert_tensor_and_model == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert g.expert_data == [[r] for r in range(8)]
    assert g.expert_tensor_model_pipeline == [list(range(8))]


@pytest.mark.parametrize(
    ("args", "words"),
    [
        ((8, 1, 1, 1, 3, None), ["world size 8", "expert_model_parallel_size (3)", "= 3"]),
        ((8, 2, 2, 1, 4, None), ["expert_tensor_parallel_size (2)", "(4)", "(2) = 16"]),
        ((8, 1, 1, 1, 0, None), ["expert_model_parallel_size", "got 0"]),
        ((8, 1, 1, 1, 1, 0), ["expert_tensor_parallel_size", "got 0"]),
    ],
)
def test_bad_expert_sizes_named(args, words):
    world, tp, pp, cp, ep, etp = args
    with pytest.raises(ValueError, match="initialize_model_parallel") as err:
        ps.parallel_groups(
            world, tp, pp, cp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp
        )
    for word in words:
        assert word in str(err.value)
