"""Sliding-window attention and attention sinks in training (model.window_size, layer_types,
softmax_type = "learnable"): a Llama whose layers alternate sliding and full attention, with
sinks, takes the one-process steps at every layout — tp 2 with sequence parallelism, cp 2 and 4
by both comm types (the window shorter than a cp 2 chunk and longer than a cp 4 one), pp 2,
dp 2 with the distributed optimizer, with and without packed documents — and a run stopped
with a save at cp 2 goes on at tp 2; with gpt-oss's MLP (biased router, biased clamped
experts) on the same attention, at ep 2 alone, with cp 2 (packed) and with tp 2 + sp, and
fully sharded (FSDP2) at dp 4.  Every
rank runs under the NCCL-semantics checker.
megacore's tests prove the attention itself (test_attention_kernels, test_context_parallel)."""

import pytest

from megacore.testing import run_distributed
from megatrain.config import ConfigError, load_config, validate
from megatrain.run.loop import train
from megatrain.testing import QUIET_LOGGING, TINY_MODEL, assert_same_steps, write_counting_corpus

VOCAB = 200
STEPS = 3
FP32_TOL = 2e-5
WINDOWED = [
    'model.kind="llama"',
    "model.num_query_groups=2",
    "model.init_method_std=0.25",  # sharp attention: a wrong mask changes the loss
    "model.window_size=5",  # under a cp 2 chunk (32 / 4 = 8 tokens), over a cp 4 one (4)
    'model.layer_types=["sliding_attention", "full_attention", "sliding_attention", '
    '"full_attention"]',
    'model.softmax_type="learnable"',
]
COMMON = [
    *TINY_MODEL,
    *QUIET_LOGGING,
    *WINDOWED,
    "training.seq_length=32",
    "training.micro_batch_size=2",
    "training.global_batch_size=8",
    f"training.train_iters={STEPS}",
    f"training.eval_interval={STEPS}",
    "training.eval_iters=1",
    "optimizer.lr=0.003",
    "optimizer.lr_warmup_iters=1",
]
PACKED = ["data.reset_position_ids=true", "data.reset_attention_mask=true"]
# gpt-oss's MLP on the same attention: 4 experts, 2 a token (top 2 of the biased router's
# logits, a softmax over them), biases on every linear, the clamped (up + 1) gate sigmoid(1.702
# gate) experts (Megatron-LM's quick_geglu, glu_linear_offset, activation_func_clamp_value).
GPT_OSS_MLP = [
    "model.num_moe_experts=4",
    "model.moe_router_topk=2",
    "model.ffn_hidden_size=32",
    "model.add_bias_linear=true",
    "model.quick_geglu=true",
    "model.glu_linear_offset=1.0",
    "model.activation_func_clamp_value=7.0",
    "model.moe_aux_loss_coeff=0.01",
]
EP2 = ["parallel.expert_model_parallel_size=2"]


def cp(size, comm="p2p"):
    return [f"parallel.context_parallel_size={size}", f"parallel.cp_comm_type={comm!r}"]


TP2_SP = ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"]
# name: (packed, overrides); 4 ranks each (dp fills the rest).
LAYOUTS = {
    "tp2-seqpar-dp2": (False, TP2_SP),
    "cp2-p2p-dp2-packed": (True, cp(2)),
    "cp2-allgather-tp2": (False, [*cp(2, "allgather"), "parallel.tensor_model_parallel_size=2"]),
    "cp4-p2p": (False, cp(4)),
    "cp4-allgather-packed": (True, cp(4, "allgather")),
    "pp2-dp2-distopt-packed": (
        True, ["parallel.pipeline_model_parallel_size=2", "parallel.use_distributed_optimizer=true"]
    ),
}  # fmt: skip
# The gpt-oss-like model (its own reference): experts over 2 EP ranks, with cp 2, with tp 2;
# fully sharded (FSDP2) over 4 ranks.
MOE_LAYOUTS = {
    "moe-fsdp-dp4": [*GPT_OSS_MLP, 'parallel.data_parallel_sharding="full"'],
    "moe-ep2-dp2": [*GPT_OSS_MLP, *EP2],
    "moe-ep2-cp2-p2p-packed": [*GPT_OSS_MLP, *EP2, *cp(2), *PACKED],
    "moe-ep2-tp2-seqpar": [*GPT_OSS_MLP, *EP2, *TP2_SP],
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return str(write_counting_corpus(tmp_path_factory.mktemp("corpus"), VOCAB))


def _config(corpus, out, packed, overrides=()):
    return load_config(
        None,
        [
            f"data.corpus={corpus!r}",
            f"training.output_dir={out!r}",
            *COMMON,
            *(PACKED if packed else []),
            *overrides,
        ],
    )


def _references(corpus, out):
    runs = {packed: train(_config(corpus, f"{out}/{packed}", packed)) for packed in (False, True)}
    # Controls: no sinks, no windows (each changes the steps, so the layouts' equality means
    # they computed both).
    runs["no sinks"] = train(
        _config(corpus, f"{out}/no-sinks", False, ['model.softmax_type="vanilla"'])
    )
    runs["full"] = train(
        _config(corpus, f"{out}/full", False, ["model.window_size=32", "model.layer_types=null"])
    )
    runs["moe"] = train(_config(corpus, f"{out}/moe", False, GPT_OSS_MLP))
    runs["moe-packed"] = train(_config(corpus, f"{out}/moe-packed", True, GPT_OSS_MLP))
    return runs


def _layouts(corpus, out):
    runs = {
        name: train(_config(corpus, f"{out}/{name}", packed, o))
        for name, (packed, o) in LAYOUTS.items()
    }
    runs |= {
        name: train(_config(corpus, f"{out}/{name}", False, o)) for name, o in MOE_LAYOUTS.items()
    }
    ckpt = f"{out}/ckpt"
    save = ["training.exit_interval=2", f"checkpoint.save={ckpt!r}"]
    runs["first"] = train(_config(corpus, f"{out}/first", False, [*cp(2), *save]))
    runs["at-tp2"] = train(
        _config(corpus, f"{out}/at-tp2", False, [*TP2_SP, f"checkpoint.load={ckpt!r}"])
    )
    return runs


@pytest.fixture(scope="module")
def references(corpus, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("window-one"))
    return run_distributed(_references, 1, args=(corpus, out), timeout=300)[0]


@pytest.fixture(scope="module")
def layouts(corpus, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("window-layouts"))
    return run_distributed(_layouts, 4, args=(corpus, out), timeout=500)[0]


def test_every_layout_of_windows_and_sinks_equals_one_process(references, layouts):
    for name, (packed, _) in LAYOUTS.items():
        assert_same_steps(layouts[name], references[packed], name, FP32_TOL)
    for name in MOE_LAYOUTS:
        reference = references["moe-packed" if "packed" in name else "moe"]
        assert_same_steps(layouts[name], reference, name, FP32_TOL)
    assert abs(references["moe"]["loss"][-1] - references[False]["loss"][-1]) > 1e-3
    for control in ("no sinks", "full"):
        assert abs(references[control]["loss"][-1] - references[False]["loss"][-1]) > 1e-3
    assert references[True]["loss"] != references[False]["loss"]


def test_a_cp2_checkpoint_with_sinks_goes_on_at_tp2(references, layouts):
    first, run = layouts["first"], layouts["at-tp2"]
    assert first["stopped_at"] == 2
    steps = {k: first[k] + run[k] for k in ("loss", "grad_norm")}
    steps["valid"] = run["valid"]
    assert_same_steps(steps, references[False], "cp2 -> tp2", FP32_TOL)


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        (["model.window_size=0"], r"model.window_size must be > 0"),
        (['model.kind="bert"', "model.window_size=4"], "sliding windows are causal attention"),
        (
            ['model.layer_types=["sliding_attention"]'],
            r"model.layer_types must list one type a layer \(4 for model.num_layers\)",
        ),
        (['model.layer_types=["sliding", "full", "full", "full"]'], "entries must be one of"),
        (["model.window_size=null"], "model.layer_types names sliding layers but"),
        (['model.softmax_type="off"'], "model.softmax_type must be one of"),
        (["model.attention_dropout=0.1"], "needs model.attention_dropout = 0"),
        (
            [
                "model.multi_latent_attention=true",
                "model.num_query_groups=null",
                "model.window_size=null",
                "model.layer_types=null",
            ],
            "only the multi-head attention kind carries sinks",
        ),
        (
            [
                "model.multi_latent_attention=true",
                "model.num_query_groups=null",
                'model.softmax_type="vanilla"',
            ],
            "only the multi-head attention kind takes sliding windows",
        ),
    ],
)
def test_bad_window_and_sink_configs_refused_naming_the_field(overrides, pattern):
    with pytest.raises(ConfigError, match=pattern):
        validate(load_config(None, [*TINY_MODEL, *WINDOWED, "training.seq_length=32", *overrides]))


def test_sliding_layers_count_their_band_of_scores():
    """FLOPs: a sliding layer's attention core counts queries x min(window, keys) scores (the
    band), a kernel skipping what no query sees that band less its causal corner; full layers
    the square; a window spanning the sequence counts as full attention."""
    from megatrain.models import TransformerConfig
    from megatrain.plan.accounting.flops import attention_core_flops, transformer_forward_flops

    types = ("sliding_attention", "full_attention") * 2
    base = dict(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=128,
                max_position_embeddings=64)  # fmt: skip
    plain = TransformerConfig(**base)
    windowed = TransformerConfig(**base, window_size=8, layer_types=types)
    s, width = 64, 2 * 32  # q.k and p.v over every head's width
    square, band = 2 * s * s * width, 2 * s * 8 * width
    assert transformer_forward_flops(plain, 1, s)[1] == 4 * square
    assert transformer_forward_flops(windowed, 1, s)[1] == 2 * square + 2 * band
    assert transformer_forward_flops(windowed, 1, s)[0] == transformer_forward_flops(plain, 1, s)[0]
    assert attention_core_flops(windowed, s, s, True, 8) == band * (1 - 8 / (2 * s))
    assert attention_core_flops(windowed, s, s, True, None) == square / 2
    spanning = TransformerConfig(**base, window_size=s)
    assert transformer_forward_flops(spanning, 1, s) == transformer_forward_flops(plain, 1, s)


def test_the_blocked_window_path_equals_the_masked_one():
    """The CPU's sliding-window path for long sequences (`core.windowed_attention`: blocks of
    queries, each against only the keys its window reaches) equals attention with the full
    s x s window mask in float64 — output and q, k, v and sink gradients — with grouped K/V,
    packed documents and sinks, at lengths that leave a partial last block; `attend` takes it
    when the sequence exceeds two blocks."""
    import torch

    from megacore.attention_kernels import attention_with_sinks
    from megatrain.models.attention.core import attend, windowed_attention
    from megatrain.models.attention.inputs import AttentionInputs
    from megatrain.models.attention.masks import causal_mask, document_mask

    g = torch.Generator().manual_seed(0)
    for s, window, documents, with_sinks in (
        (300, 7, False, False), (300, 70, True, True), (257, 64, True, False), (200, 5, False, True)
    ):  # fmt: skip
        q = torch.randn(2, 4, s, 16, generator=g, dtype=torch.float64, requires_grad=True)
        k, v = (
            torch.randn(2, 2, s, 16, generator=g, dtype=torch.float64, requires_grad=True)
            for _ in "kv"
        )
        sinks = None
        if with_sinks:
            sinks = torch.randn(4, generator=g, dtype=torch.float64, requires_grad=True)
        segments = None  # else documents of their own in each sequence
        if documents:
            segments = torch.stack([torch.arange(s) // 90, torch.arange(s) // 70])
        mask = document_mask(segments, window) if documents else causal_mask(s, window, "cpu")
        if with_sinks:
            reference = attention_with_sinks(q, k, v, sinks, mask=mask)
        else:
            reference = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, enable_gqa=True
            )
        inputs = AttentionInputs(segments=segments, seq_len=s)
        through_attend = attend(q, k, v, inputs, causal=True, dropout_p=0.0, tp_size=1,
                                context_parallel=None, window=window, sinks=sinks)  # fmt: skip
        blocked = windowed_attention(q, k, v, window, segments, sinks)
        assert torch.equal(through_attend, blocked)
        leaves = [q, k, v] + ([sinks] if with_sinks else [])
        upstream = torch.randn(blocked.shape, generator=g, dtype=torch.float64)
        ours = torch.autograd.grad(blocked, leaves, upstream)
        theirs = torch.autograd.grad(reference, leaves, upstream)
        assert (blocked - reference).abs().max() < 1e-12
        for a, b in zip(ours, theirs, strict=True):
            assert (a - b).abs().max() < 1e-12


def test_the_planner_times_a_sliding_layer_by_its_band():
    """`megatrain plan`'s attention core time (the fused kernels') of a model alternating
    sliding and full layers is the mean of the two layers' FLOPs at the kernel's rate: below
    the full model's by the band's share, equal to it when the window spans the sequence."""
    from megatrain.models import model_config
    from megatrain.plan import hardware
    from megatrain.plan.attention_time import attention_core_seconds, layer_mean_core_flops
    from megatrain.plan.costs import Costs
    from megatrain.plan.layout import Layout

    def seconds(overrides):
        config = load_config(None, [*TINY_MODEL, *WINDOWED, "training.seq_length=4096",
                                    "model.max_position_embeddings=4096",
                                    'training.precision="bf16"', *overrides])  # fmt: skip
        cfg = model_config(config, 50257)
        gpu = hardware.load_gpus()["h100-80gb"]
        layout = Layout(tp=1, pp=1, dp=1, micro_batch=1)
        costs = Costs(gpu, hardware.gpu_profile(gpu), "bf16")
        return sum(f + b for f, b in attention_core_seconds(config, cfg, layout, costs)), cfg

    windowed, cfg = seconds([])
    full, full_cfg = seconds(["model.window_size=4096"])
    ratio = layer_mean_core_flops(cfg, 4096, 4096, True) / layer_mean_core_flops(
        full_cfg, 4096, 4096, True
    )
    assert 0.4 < ratio < 0.6  # half the layers slide over 5 of 4096 keys
    assert windowed < full


def test_the_planner_times_a_sliding_layers_ring_as_megacore_runs_it():
    """Under p2p context parallelism megacore runs a sliding layer on its float32 ring (the
    fused kernels take no window), computing only the blocks a local query sees: the plan
    times it so.  A window spanning the sequence costs what the float32 ring of packed
    documents does (every block); a 5-key window over chunks of 512 only the blocks holding a
    chunk just before one of the rank's own (2.5 of 4 on average: megacore's own skips); gpt-oss's
    alternation the mean of the fused ring's and the windowed float32 ring's layers."""
    from megacore.context_parallel import steps_outside_window
    from megatrain.models import model_config
    from megatrain.plan import hardware
    from megatrain.plan.attention_time import _blocks_seen, attention_core_seconds
    from megatrain.plan.costs import Costs
    from megatrain.plan.layout import Layout

    def seconds(overrides):
        config = load_config(None, [*TINY_MODEL, 'model.kind="llama"', "model.num_query_groups=2",
                                    "training.seq_length=4096", "parallel.context_parallel_size=4",
                                    "model.max_position_embeddings=4096",
                                    'parallel.cp_comm_type="p2p"', 'training.precision="bf16"',
                                    *overrides])  # fmt: skip
        gpu = hardware.load_gpus()["h100-80gb"]
        layout = Layout(tp=1, pp=1, dp=1, micro_batch=1, cp=4, cp_comm="p2p")
        costs = Costs(gpu, hardware.gpu_profile(gpu), "bf16")
        parts = attention_core_seconds(config, model_config(config, 50257), layout, costs)
        return sum(f + b for f, b in parts)

    assert [steps_outside_window(512, r, 4, 5) for r in range(4)] == [{1, 2}, {2}, {2}, {2, 3}]
    assert _blocks_seen(4096, 4, 5) == 2.5 and _blocks_seen(4096, 4, 4096) == 4
    fused, documents = seconds([]), seconds(["data.reset_attention_mask=true"])
    spanning, narrow = seconds(["model.window_size=4096"]), seconds(["model.window_size=5"])
    assert spanning == pytest.approx(documents) and fused < documents
    assert narrow < spanning
    alternating = seconds(["model.window_size=5", 'model.layer_types=["sliding_attention", '
                           '"full_attention", "sliding_attention", "full_attention"]'])  # fmt: skip
    assert alternating == pytest.approx((fused + narrow) / 2)
