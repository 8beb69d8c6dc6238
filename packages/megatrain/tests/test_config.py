"""Configs and the learning-rate schedule: plain functions, no processes (FLOPs: test_flops.py)."""

import itertools
import math
from pathlib import Path

import pytest

from megatrain.config import ConfigError, load_config, validate
from megatrain.models import model_config
from megatrain.plan.accounting import gpt_parameters as num_parameters
from megatrain.plan.accounting import parameter_count
from megatrain.run.lr_schedule import learning_rate

MODELS = Path(__file__).resolve().parents[3] / "pipelines" / "models"
# name: (the paper's parameter count, tensor-parallel size, 8-GPU nodes in the paper's run)
PAPER = {
    "355m": (355e6, 1, 1),
    "1.2b": (1.2e9, 1, 1),
    "2.5b": (2.5e9, 2, 2),
    "4.2b": (4.2e9, 4, 4),
    "8.3b": (8.3e9, 8, 64),
}


@pytest.mark.parametrize("name", sorted(PAPER))
def test_paper_configs(name):
    params, tp, nodes = PAPER[name]
    config = load_config(MODELS / f"gpt2-{name}.toml")
    assert config.parallel.tensor_model_parallel_size == tp
    t, o = config.training, config.optimizer
    assert (t.seq_length, t.global_batch_size, t.train_iters, t.precision) == (
        1024,
        512,
        300000,
        "fp16",
    )
    assert (o.lr, o.min_lr, o.lr_warmup_iters, o.lr_decay_style) == (1.5e-4, 1e-5, 3000, "cosine")
    assert (o.weight_decay, o.clip_grad, config.model.hidden_dropout) == (0.01, 1.0, 0.1)
    assert config.model.recompute != "none"  # which one: by memory, test_memory.py
    dp = validate(config, nodes * 8)
    assert dp == nodes * 8 // tp
    model = model_config(config, 50257)
    assert model.vocab_size == -(-50257 // (128 * tp)) * 128 * tp
    assert abs(num_parameters(model) / params - 1) < 0.02, num_parameters(model)


# Table 4: name -> (parameters, layers, hidden, heads, model-parallel size)
BERT_PAPER = {
    "336m": (336e6, 24, 1024, 16, 1),
    "1.3b": (1.3e9, 24, 2048, 32, 2),
    "3.9b": (3.9e9, 48, 2560, 40, 4),
}


@pytest.mark.parametrize("name", sorted(BERT_PAPER))
def test_bert_paper_configs(name):
    params, layers, hidden, heads, tp = BERT_PAPER[name]
    config = load_config(MODELS / f"bert-{name}.toml")
    m, t, o, d = config.model, config.training, config.optimizer, config.data
    assert (m.kind, m.block_order, m.vocab_size) == ("bert", "pre_ln", 30522)
    assert (m.num_layers, m.hidden_size, m.num_attention_heads) == (layers, hidden, heads)
    assert m.hidden_size // m.num_attention_heads == 64
    assert config.parallel.tensor_model_parallel_size == tp
    assert (t.seq_length, t.global_batch_size, t.train_iters) == (512, 1024, 2_000_000)
    assert (o.lr, o.lr_warmup_iters, o.lr_decay_style, o.lr_decay_iters) == (
        1e-4,
        10_000,
        "linear",
        2_000_000,
    )
    assert (d.masked_lm_prob, d.max_ngram) == (0.15, 3)
    model = model_config(config, 30522)
    assert (model.causal, model.gelu, model.num_tokentypes) == (False, "erf", 2)
    assert abs(parameter_count("bert", model) / params - 1) < 0.02, parameter_count("bert", model)


def test_every_shipped_config_loads():
    for path in MODELS.glob("*.toml"):
        validate(load_config(path))


def test_overrides_keep_types_and_none():
    config = load_config(
        MODELS / "gpt2-tiny.toml",
        ["optimizer.lr=3e-4", "training.precision=bf16", "model.ffn_hidden_size=100",
         "parallel.virtual_pipeline_model_parallel_size=none", "optimizer.lr_decay_iters=5"],
    )  # fmt: skip
    assert config.optimizer.lr == 3e-4 and config.training.precision == "bf16"
    assert (
        config.ffn_hidden_size == 100
        and config.parallel.virtual_pipeline_model_parallel_size is None
    )
    assert load_config(None, ["optimizer.lr=1"]).optimizer.lr == 1.0  # an int is a float
    with pytest.raises(ConfigError, match=r"training.train_iters: a value is required"):
        load_config(None, ["training.train_iters=none"])
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(MODELS / "no-such.toml")


def test_validate_names_the_numbers():
    with pytest.raises(
        ConfigError, match=r"the job has 6 processes, not divisible by .* \(4 x 1\)"
    ):
        validate(load_config(None, ["parallel.tensor_model_parallel_size=4"]), 6)
    with pytest.raises(ConfigError, match=r"data_parallel_size is 2, but the job has 8 processes"):
        validate(load_config(None, ["parallel.data_parallel_size=2"]), 8)
    config = load_config(
        None,
        [
            "parallel.pipeline_model_parallel_size=2",
            "parallel.virtual_pipeline_model_parallel_size=2",
            "model.num_layers=4",
            "training.global_batch_size=6",
            "training.micro_batch_size=2",
        ],
    )
    with pytest.raises(ConfigError, match=r"number of microbatches .* = 3\) to be a multiple"):
        validate(config, 2)
    with pytest.raises(ConfigError, match=r"overlap_param_gather .* needs .*distributed_opt"):
        validate(load_config(None, ["parallel.overlap_param_gather=true"]), 1)


def test_pipeline_schedule_refusals_name_both_fields():
    from megacore.pipeline_parallel import SCHEDULES
    from megatrain.config import PIPELINE_SCHEDULES

    assert PIPELINE_SCHEDULES == SCHEDULES  # the config's names are the executor's

    def check(*overrides):
        base = ["parallel.pipeline_model_parallel_size=2", "model.num_layers=4"]
        return validate(load_config(None, [*base, *overrides]), 2)

    for schedule in ("1f1b", "zb-h1", None):
        named = [] if schedule is None else [f"parallel.pipeline_schedule={schedule!r}"]
        check(*named)  # accepted without virtual stages
    check(
        'parallel.pipeline_schedule="interleaved"',
        "parallel.virtual_pipeline_model_parallel_size=2",
    )
    refusals = {
        ('parallel.pipeline_schedule="gpipe"',): r"pipeline_schedule must be one of .*'zb-h1'",
        ('parallel.pipeline_schedule="interleaved"',): r"'interleaved' with "
        r"parallel.virtual_pipeline_model_parallel_size = 1: .*set the virtual size",
        (
            'parallel.pipeline_schedule="zb-h1"',
            "parallel.virtual_pipeline_model_parallel_size=2",
        ): r"'zb-h1' with parallel.virtual_pipeline_model_parallel_size = 2",
        (
            'parallel.pipeline_schedule="1f1b"',
            "parallel.virtual_pipeline_model_parallel_size=2",
        ): r"'1f1b' with parallel.virtual_pipeline_model_parallel_size = 2",
        ('parallel.pipeline_schedule="zb-h1"', "training.compile=true"): r"'zb-h1' with "
        r"training.compile = true: .*turn one of them off",
    }
    for overrides, message in refusals.items():
        with pytest.raises(ConfigError, match=message):
            check(*overrides)
    with pytest.raises(ConfigError, match=r"'zb-h1' needs pipeline stages: .*size is 1"):
        validate(load_config(None, ['parallel.pipeline_schedule="zb-h1"']), 1)


def test_pipeline_layout_is_read_and_its_refusals_name_the_field():
    """parallel.pipeline_model_parallel_layout: Megatron-LM's string (as an override hands
    it, '|' and '*' in it) or Megatron-Bridge's lists, read into the model's per-stage
    layer counts; each bad layout refused by `validate` (which `megatrain run` calls before
    any worker starts) in one line naming the field."""
    name = "parallel.pipeline_model_parallel_layout"
    base = [
        "model.num_layers=4",
        "model.mtp_num_layers=1",
        "parallel.pipeline_model_parallel_size=2",
    ]

    def config(layout, *overrides):
        return load_config(None, [*base, f"{name}={layout}", *overrides])

    for layout in ("Et*3|tmL", '"Et*3|tmL"', '[["embedding","decoder","decoder","decoder"],'
                   '["decoder","mtp","loss"]]'):  # fmt: skip
        validate(config(layout), 2)
        assert model_config(config(layout), 256).pipeline_layer_counts == (3, 1)
    cleared = config("Et*3|tmL", f"{name}=none")  # as a saved run's is cleared by override
    assert cleared.parallel.pipeline_model_parallel_layout is None
    vpp2 = config("Et|tt|t|mL", "parallel.virtual_pipeline_model_parallel_size=2")
    validate(vpp2, 2)
    assert model_config(vpp2, 256).pipeline_layer_counts == (1, 2, 1, 0)
    refusals = {
        ("Et*4mL", "parallel.pipeline_model_parallel_size=1"): r"needs parallel.pipeline_model"
        r"_parallel_size > 1",
        ("Et|t|ttmL",): r"has 3 stages; .*is 2 x 1 = 2",
        ("Et*3|ttmL",): r"holds 5 transformer layers \(t\); model.num_layers is 4",
        ("Etm|tttL",): r"the last stage must end with the model's 1 MTP depth",
        ("Et*3|tL",): r"the last stage must end with the model's 1 MTP depth",
        ("Et*3|txmL",): r"'x' is not a layout letter",
        ('[["embedding","decoder"],["decoder","block"]]',): r"stage 1 is \['decoder', 'block'\]",
        ('[["embedding","decoder"],[["loss"]]]',): r"stage 1 is \[\['loss'\]\]; each stage is",
    }
    for overrides, message in refusals.items():
        with pytest.raises(ConfigError, match=message) as refused:
            validate(config(*overrides), 2)
        assert name in str(refused.value) and "\n" not in str(refused.value), overrides
    with pytest.raises(
        ConfigError, match=rf"{name}: expected str or list or NoneType, got 3 \(int\)"
    ):
        config("3")


def test_speed_lever_refusals_name_the_fields():
    with pytest.raises(ConfigError, match=r"fused_linear_cross_entropy = true is for GPT and "):
        validate(
            load_config(None, ['model.kind="bert"', "training.fused_linear_cross_entropy=true"])
        )
    fp16 = ["training.precision='fp16'", "training.fused_linear_cross_entropy=true"]
    with pytest.raises(ConfigError, match=r"fused_linear_cross_entropy = true with training.prec"):
        validate(load_config(None, fp16))
    both = ["training.gradient_accumulation_fusion=true", "training.compile=true"]
    with pytest.raises(ConfigError, match=r"gradient_accumulation_fusion = true with training"):
        validate(load_config(None, both))
    for kind in ("gpt", "llama"):  # accepted
        levers = ["training.fused_linear_cross_entropy=true", both[0]]
        validate(load_config(None, [f"model.kind={kind!r}", *levers]))
    fp8 = "training.precision='fp8'"
    refusals = {
        (fp8, both[0]): r"'fp8' with training.gradient_accumulation_fusion = true: torchao",
        (fp8, "parallel.pipeline_model_parallel_size=2", "parallel.pipeline_schedule='zb-h1'"): (
            r"'fp8' with parallel.pipeline_schedule = 'zb-h1'"
        ),
        ("training.fp8_emulate=true",): r"fp8_emulate = true with training.precision = 'fp32'",
    }
    for overrides, message in refusals.items():
        with pytest.raises(ConfigError, match=message):
            validate(load_config(None, list(overrides)), 2)
    # Where float8 GEMMs cannot run, the run stops before any weight is built, saying why.
    import torch

    from megacore import tensor_parallel as tp

    with pytest.raises(RuntimeError, match=r"fp8 training needs an NVIDIA GPU .* on 'cpu'"):
        tp.check_float8_available(torch.device("cpu"), emulate=False)
    tp.check_float8_available(torch.device("cpu"), emulate=True)  # torchao's emulation runs


def test_tp_comm_overlap_needs_tensor_and_sequence_parallelism():
    overlap = "parallel.tp_comm_overlap=true"
    tp2, sp = "parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"
    config = load_config(None, [overlap, tp2, sp])
    validate(config, 2)  # accepted
    assert model_config(config, 200).tp_comm_overlap  # and reaches the model's build
    assert not model_config(load_config(None, [tp2, sp]), 200).tp_comm_overlap  # off by default
    needs = r"parallel.tp_comm_overlap = true .* needs parallel.tensor_model_parallel_size > 1 "
    refusals = {
        (overlap,): needs + r"\(it is 1\) and parallel.sequence_parallel = true \(it is false\)",
        (overlap, sp): needs + r"\(it is 1\)",
        (overlap, tp2): needs + r"\(it is 2\) and parallel.sequence_parallel = true \(it is false",
        (overlap, tp2, sp, "training.precision='fp8'"): (
            r"'fp8' with parallel.tp_comm_overlap = true: .*turn parallel.tp_comm_overlap off"
        ),
    }
    for overrides, message in refusals.items():
        with pytest.raises(ConfigError, match=message):
            validate(load_config(None, list(overrides)), 2)


def test_cuda_graphs_refusals_name_the_fields():
    graphs = "training.cuda_graphs=true"
    refusals = {
        ("parallel.pipeline_model_parallel_size=2",): r"cuda_graphs = true with parallel.pipeline"
        r"_model_parallel_size = 2: a layer's graph holds the activations of one microbatch",
        ('model.recompute="selective"',): r"with model.recompute = 'selective': recompute swaps",
        ("training.compile=true",): r"with training.compile = true: choose one",
        ("parallel.use_distributed_optimizer=true", "parallel.overlap_param_gather=true"): (
            r"with parallel.overlap_param_gather = true: its forward hooks"
        ),
        ("training.precision='fp8'",): r"with training.precision = 'fp8'",
        ("parallel.tensor_model_parallel_size=2", "model.attention_dropout=0.1"): (
            r"with model.attention_dropout = 0.1 at tp 2 without sequence parallelism: .*turn "
            r"on parallel.sequence_parallel or set model.attention_dropout = 0"
        ),
    }
    for overrides, message in refusals.items():
        with pytest.raises(ConfigError, match=message):
            validate(load_config(None, [graphs, *overrides]))
    # Accepted: dropout at one TP rank, and at tp 2 under sequence parallelism (every draw
    # in a layer per rank: one fork around the layer, outside its graphs); hidden dropout
    # alone at tp 2 (the same masks on both ranks, no fork).
    dropout = ["model.hidden_dropout=0.1", "model.attention_dropout=0.1"]
    tp2 = ["parallel.tensor_model_parallel_size=2"]
    validate(load_config(None, [graphs, *dropout]))
    validate(load_config(None, [graphs, *dropout, *tp2, "parallel.sequence_parallel=true"]))
    validate(load_config(None, [graphs, *tp2, "model.attention_dropout=0.0"]))


def test_learning_rate_warmup_then_cosine_or_linear():
    kw = {"lr": 1.0, "min_lr": 0.1, "warmup_iters": 10, "decay_iters": 110}
    assert [learning_rate(i, **kw) for i in (0, 4, 9)] == [0.1, 0.5, 1.0]
    assert learning_rate(10, **kw) == 1.0
    assert math.isclose(learning_rate(60, **kw), 0.55)  # half way: cosine at pi/2
    assert math.isclose(learning_rate(35, **kw), 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert learning_rate(110, **kw) == learning_rate(10_000, **kw) == 0.1
    assert math.isclose(learning_rate(35, **kw, style="linear"), 0.1 + 0.9 * 0.75)
    assert learning_rate(500, **kw, style="constant") == 1.0
    values = [learning_rate(i, **kw) for i in range(10, 111)]
    assert all(a >= b for a, b in itertools.pairwise(values))
