"""The plan at uneven pipeline stages (parallel.pipeline_model_parallel_layout): each stage timed
and its memory counted by the layers it holds, the search trying Megatron-Bridge's split where
pp x vpp does not divide the layers (DeepSeek-V3's 61), and the layout carried to the overrides
it prints."""

from dataclasses import replace
from pathlib import Path

from megacore.pipeline_parallel import parse_pipeline_layout
from megatrain.config import load_config, validate
from megatrain.config.load import apply_overrides
from megatrain.models import model_config
from megatrain.plan import hardware, search
from megatrain.plan.accounting import activations_per_layer, stage_layers
from megatrain.plan.cost_model import estimate, layer_seconds
from megatrain.plan.costs import Costs, group_bandwidth
from megatrain.plan.layout import Layout, apply_layout, balanced_pipeline_layout
from megatrain.plan.memory import memory_breakdown, weighed_stages

MODELS = Path(__file__).resolve().parents[3] / "pipelines" / "models"
H100 = hardware.load_gpus()["h100-80gb"]
HOPPER = hardware.gpu_profile(H100)
VOCAB = 129280
PARTS = ("compute", "tp_comm", "cp_comm", "ep_comm")

# Megatron-Bridge's DeepSeek-V3 layouts (recipes/deepseek/deepseek_v3.py, layout_map), as the
# layers of each virtual stage: (pp, vp) -> counts, the MTP depth and the loss on the last.
BRIDGE = {
    (4, 1): [16, 16, 16, 13],
    (8, 1): [8] * 7 + [5],
    (4, 2): [8] * 7 + [5],
    (16, 1): [4] * 15 + [1],
    (8, 2): [4] * 15 + [1],
    (4, 4): [4] * 15 + [1],
}


def _tiny():
    """deepseek-tiny in bf16: a dense first layer, three MoE layers, one MTP depth."""
    config = load_config(MODELS / "deepseek-tiny.toml")
    return replace(config, training=replace(config.training, precision="bf16"))


def test_the_balanced_split_is_megatron_bridges_for_deepseek_v3():
    for (pp, vp), counts in BRIDGE.items():
        layout = balanced_pipeline_layout(61, pp, vp, 1)
        assert parse_pipeline_layout(layout, pp, vp, 61, 1) == counts, (pp, vp)
    assert balanced_pipeline_layout(61, 8, 4, 1) is None  # 2 a stage leave the last -1
    assert balanced_pipeline_layout(64, 4, 2) is None  # even: no layout needed
    assert balanced_pipeline_layout(61, 1, 1) is None


def test_a_stage_is_timed_by_the_layers_it_holds():
    """deepseek-tiny at pp 2: "Et*3|tmL" moves one MoE layer from the last stage to the first,
    whose time grows by exactly that layer's and the last's shrinks by it; "Et*2|t*2mL" is the
    even split, estimated the same in every part."""
    config = _tiny()
    base = Layout(tp=2, pp=2, dp=2, micro_batch=2, sequence_parallel=True, ep=2)
    even = estimate(config, base, H100, HOPPER, VOCAB)
    same = estimate(config, replace(base, pipeline_layout="Et*2|t*2mL"), H100, HOPPER, VOCAB)
    assert same.time == even.time and same.memory == even.memory
    uneven = estimate(config, replace(base, pipeline_layout="Et*3|tmL"), H100, HOPPER, VOCAB)
    at = apply_layout(config, base)
    costs = Costs(H100, HOPPER, "bf16")
    moe = layer_seconds(
        at, base, costs, group_bandwidth(H100, 2, 1), group_bandwidth(H100, 1, 2), True,
        group_bandwidth(H100, 2, 2), model_config(at, VOCAB),
    )  # fmt: skip
    layer = sum(moe[k] for k in PARTS)
    (first, last), (first_even, last_even) = (
        uneven.notes["stage_seconds"],
        even.notes["stage_seconds"],
    )
    assert abs(first - first_even - layer) < 1e-12 and abs(last_even - last - layer) < 1e-12
    assert uneven.memory != even.memory


def test_each_stage_counts_the_layers_of_its_chunks():
    """DeepSeek-V3 at pp 4 x vp 4, Megatron-Bridge's layout without MTP: rank 0 holds chunks 0, 4,
    8 and 12 (layers 0-3, 16-19, 32-35, 48-51: the 3 dense ones among them), rank 3 chunks 3, 7,
    11 and 15 (13 layers, the last one alone); the memory weighs rank 0, the first middle rank
    (1 and 2 hold the same) and the last; a middle rank's parameters are its 16 MoE layers'."""
    config = load_config(
        MODELS / "deepseek-v3.toml",
        [
            "parallel.tensor_model_parallel_size=1",
            "parallel.sequence_parallel=false",
            "parallel.pipeline_model_parallel_size=4",
            "parallel.virtual_pipeline_model_parallel_size=4",
            'parallel.pipeline_model_parallel_layout="Et*4|(t*4|)*14tL"',
            "parallel.expert_model_parallel_size=64",
            "model.mtp_num_layers=none",
        ],
    )
    cfg = model_config(config, VOCAB)
    assert [stage_layers(cfg, 4, r) for r in range(4)] == [(3, 13), (0, 16), (0, 16), (0, 13)]
    assert weighed_stages(config) == [0, 1, 3]
    middle, second = (
        memory_breakdown(config, vocab_size=VOCAB, data_parallel_size=64, stage=r) for r in (1, 2)
    )
    assert middle["parameters"] == second["parameters"]  # 16 MoE layers each
    # interleaved over 4 x 4: rank r holds pp - r + (pp - 2 r - 1) / vp microbatches' layers in
    # flight, 3.25 at rank 1 and 1.75 at rank 2: 1.5 x 16 MoE layers' activations apart
    per_layer = activations_per_layer(config, "full", True, "flash")
    assert abs(middle["activations"] - second["activations"] - 1.5 * 16 * per_layer) < 1e-3


def test_the_search_tries_uneven_splits_and_prints_them_as_overrides():
    """deepseek-tiny with 5 layers on 4 GPUs: pp 2 splits them only unevenly, which the search
    now tries (1F1B, ZB-H1 and interleaved at vp 2 and 4 by the balanced split); every pp 2
    layout it ranks carries its layout, and its overrides make a config `megatrain run`
    accepts at that layout."""
    config = _tiny()
    config = replace(
        config,
        model=replace(config.model, num_layers=5, moe_layer_freq=[0, 1, 1, 1, 1]),
        training=replace(config.training, global_batch_size=16, micro_batch_size=2),
    )
    # vp 2 and 4 leave the last stage no layer (2 a stage over 4, 1 over 8): not tried
    assert search._pipelines(config, 2) == [
        (1, "1f1b", "Et*3|t*2mL"),
        (1, "zb-h1", "Et*3|t*2mL"),
    ]
    # an even split keeps its own: 1F1B, ZB-H1 and interleaved at each vp dividing the layers
    assert search._pipelines(_tiny(), 2) == [
        (1, "1f1b", None),
        (1, "zb-h1", None),
        (2, "interleaved", None),
    ]
    result = search.plan(config, 4, H100, HOPPER, VOCAB, fixed={"pp": 2})
    assert result.ranked, result.rejected
    for ranked in result.ranked:
        assert ranked.layout.pipeline_layout is not None
    best = result.ranked[0].layout
    again = load_config(MODELS / "deepseek-tiny.toml")
    again = replace(again, model=replace(again.model, num_layers=5, moe_layer_freq=[0, 1, 1, 1, 1]))
    apply_overrides(again, [*best.overrides(), "training.global_batch_size=16"])
    assert again.parallel.pipeline_model_parallel_layout == best.pipeline_layout
    validate(replace(again, model=replace(again.model, vocab_size=VOCAB)), world_size=4)


def test_fsdp_shards_the_experts_over_their_own_group():
    """FSDP with the experts split over EP ranks (parallel.data_parallel_sharding = "full"):
    the dense parameters are gathered and reduce-scattered over the dense data-parallel ranks,
    the experts over their own (expert data-parallel) group, which at ep = dp is one rank:
    nothing to move, so the step's data-parallel time is the dense parameters' alone, as
    cost_model._fsdp_exposed gives it from one layer's times; at ep 2 the experts' exposure
    adds to it."""
    from megatrain.plan.cost_model import _fsdp_exposed

    config = _tiny()
    layout = Layout(tp=1, pp=1, dp=4, micro_batch=2, fsdp=True, ep=4, etp=1)
    result = estimate(config, layout, H100, HOPPER, VOCAB)
    at = apply_layout(config, layout)
    costs = Costs(H100, HOPPER, "bf16")
    cfg = model_config(at, VOCAB)
    layer = layer_seconds(
        at, layout, costs, group_bandwidth(H100, 1, 1), group_bandwidth(H100, 1, 1), cfg=cfg
    )
    dense = result.memory["parameters"] - result.memory["expert_parameters"]
    bandwidth = group_bandwidth(H100, 4, 1)
    layers, microbatches = cfg.num_layers, result.notes["microbatches"]
    by_hand = _fsdp_exposed(
        costs.collective("all_gather", costs.element * dense, 4, bandwidth),
        costs.collective("reduce_scatter", 4 * dense, 4, bandwidth),
        layers * (layer["compute"] - layer["backward"]),
        layers * layer["backward"],
        layers,
        microbatches,
        1,
        True,
    )
    assert result.memory["expert_parameters"] > 0
    assert abs(result.time["dp_comm"] - sum(by_hand)) < 1e-12
    sharded = estimate(config, replace(layout, ep=2), H100, HOPPER, VOCAB)
    assert sharded.time["dp_comm"] > result.time["dp_comm"]


def test_fsdp_gathers_the_stages_own_and_its_largest_layers():
    """DeepSeek-V3 under FSDP at ep 256 (1 expert a rank and layer): its 3 dense layers (583M
    parameters each) are larger than its 58 MoE layers at that layout; FSDP holds, besides its
    shards, the stage's own parameters (embedding, output layer, MTP depth) gathered, two
    layers of the largest (the computing one and the prefetched, resharded after the
    forward), and one such layer's 16-bit and fp32 gradients (every microbatch reduced)."""
    from megatrain.plan.accounting import layer_parameters_per_rank

    config = load_config(MODELS / "deepseek-v3.toml")
    layout = Layout(tp=1, pp=1, dp=256, micro_batch=2, recompute="full", fsdp=True, ep=256,
                    reduce_every_microbatch=True)  # fmt: skip
    at = apply_layout(config, layout)
    cfg = model_config(at, VOCAB)
    memory = memory_breakdown(at, vocab_size=VOCAB, data_parallel_size=256)
    dense, moe = layer_parameters_per_rank(cfg, 1), layer_parameters_per_rank(cfg, 1, True, 256, 1)
    assert dense > moe
    own = memory["parameters"] - 3 * dense - 58 * moe
    assert own > 0
    assert memory["gathered"] == 2 * (own + 2 * dense) + (2 + 4) * dense


def test_plan_fix_searches_only_those_splits():
    """`megatrain plan --fix pp=2 --fix ep=2`: every layout weighed and ranked at pp 2 and ep 2
    (the uneven split among them, deepseek-tiny's 5 layers), the report saying so; a malformed
    --fix is refused naming it."""
    import json

    from click.testing import CliRunner

    from megatrain.cli import main
    from megatrain.plan.search import parse_fixed

    args = [
        "plan", "--config", str(MODELS / "deepseek-tiny.toml"), "--gpus", "4",
        "--gpu", "h100-80gb", "model.vocab_size=1024", "model.num_layers=5",
        "model.moe_layer_freq=[0, 1, 1, 1, 1]", "--fix", "pp=2", "--fix", "ep=2",
    ]  # fmt: skip
    text = CliRunner().invoke(main, args).output
    assert "searched only: pp 2, ep 2 (--fix)" in text
    data = json.loads(CliRunner().invoke(main, [*args, "--json", "--top", "50"]).output)
    assert data["fixed"] == {"pp": 2, "ep": 2} and data["layouts"]
    assert {(e["layout"]["pp"], e["layout"]["ep"]) for e in data["layouts"]} == {(2, 2)}
    assert parse_fixed(["etp=none", "cp_comm=latent"]) == {"etp": None, "cp_comm": "latent"}
    refused = CliRunner().invoke(main, [*args, "--fix", "pp=0"])
    assert refused.exit_code != 0
    assert "--fix 'pp=0': pp takes a whole number above 0" in refused.output
