"""Context parallelism in training (parallel.context_parallel_size, cp_comm_type): every layout
takes the one-process steps, for GPT-2 (learned positions) and Llama (rotary positions,
grouped-query attention), with and without packed documents.

One 1-rank spawn trains the references; one 8-rank spawn trains the layouts (cp 2 and 4 with
both comm types, with tp 2 and sequence parallelism, pp 2 under 1F1B, interleaving and ZB-H1,
dp 2 with the distributed optimizer, selective and full recompute; multi-latent attention's
latent gather at tp 2 + sp), and a run stopped with a save at cp 2 goes on at cp 4 and at
cp 1.  Every rank runs under the NCCL-semantics checker.
megacore's tests prove the attention itself against full attention (test_context_parallel)."""

import pytest
from test_multi_latent_attention import MLA_FIELDS

from megacore.testing import run_distributed
from megatrain.config import ConfigError, load_config, validate
from megatrain.run.loop import train
from megatrain.testing import QUIET_LOGGING, TINY_MODEL, assert_same_steps, write_counting_corpus

VOCAB = 200
STEPS = 3
FP32_TOL = 2e-5
COMMON = [
    *TINY_MODEL,
    *QUIET_LOGGING,
    "training.seq_length=16",
    "training.micro_batch_size=2",
    "training.global_batch_size=16",
    f"training.train_iters={STEPS}",
    f"training.eval_interval={STEPS}",
    "training.eval_iters=1",
    "optimizer.lr=0.003",
    "optimizer.lr_warmup_iters=1",
]
LLAMA = [
    'model.kind="llama"',
    "model.num_query_groups=2",
    "model.normalization='rmsnorm'",
    "model.position_embedding_type='rope'",
    "model.init_method_std=0.25",  # sharp attention: wrong positions change the loss
]
# Llama with DeepSeek's multi-latent attention (its own heads: no query groups).
MLA = [*(o for o in LLAMA if not o.startswith("model.num_query_groups")), *MLA_FIELDS]
PACKED = [
    "data.reset_position_ids=true",
    "data.reset_attention_mask=true",
    "data.eod_mask_loss=true",
]


def cp(size, comm="p2p"):
    return [f"parallel.context_parallel_size={size}", f"parallel.cp_comm_type={comm!r}"]


TP2_SP = ["parallel.tensor_model_parallel_size=2", "parallel.sequence_parallel=true"]
PP2 = ["parallel.pipeline_model_parallel_size=2"]
# name: (model, packed, overrides); 8 ranks each (dp fills the rest).
LAYOUTS = {
    "gpt-cp2-p2p-dp4": ("gpt", False, cp(2)),
    "gpt-cp4-allgather-dp2-distopt": (
        "gpt", False, [*cp(4, "allgather"), "parallel.use_distributed_optimizer=true"]),
    "gpt-cp2-tp2-seqpar-pp2-packed-selective": (
        "gpt", True, [*cp(2), *TP2_SP, *PP2, 'model.recompute="selective"']),
    "gpt-cp4-p2p-pp2-zb-h1-packed": (
        "gpt", True, [*cp(4), *PP2, 'parallel.pipeline_schedule="zb-h1"']),
    "llama-cp2-allgather-tp2-seqpar-dp2-full": (
        "llama", False, [*cp(2, "allgather"), *TP2_SP, 'model.recompute="full"']),
    "llama-cp4-p2p-dp2-packed": ("llama", True, cp(4)),
    "llama-cp2-p2p-pp2-vpp2-packed-distopt": (
        "llama", True,
        [*cp(2), *PP2, "parallel.virtual_pipeline_model_parallel_size=2",
         "parallel.use_distributed_optimizer=true"]),
    "llama-cp2-allgather-tp2-pp2-packed": ("llama", True, [*cp(2, "allgather"), *PP2,
                                                           "parallel.tensor_model_parallel_size=2"]),
    # MLA's latent gather over CP after the latent's TP gather (its other comm types and
    # layouts: test_multi_latent_attention).
    "mla-cp2-latent-tp2-seqpar-dp2-packed": ("mla", True, [*cp(2, "latent"), *TP2_SP]),
}  # fmt: skip


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return str(write_counting_corpus(tmp_path_factory.mktemp("corpus"), VOCAB))


def _config(corpus, out, model, packed, overrides=()):
    return load_config(
        None,
        [
            f"data.corpus={corpus!r}",
            f"training.output_dir={out!r}",
            *COMMON,
            *{"llama": LLAMA, "mla": MLA}.get(model, []),
            *(PACKED if packed else []),
            *overrides,
        ],
    )


def _references(corpus, out):
    runs = [(model, packed) for model in ("gpt", "llama") for packed in (False, True)]
    return {
        (model, packed): train(_config(corpus, f"{out}/{model}-{packed}", model, packed))
        for model, packed in [*runs, ("mla", True)]
    }


def _layouts(corpus, out):
    runs = {
        name: train(_config(corpus, f"{out}/{name}", model, packed, o))
        for name, (model, packed, o) in LAYOUTS.items()
    }
    # Stopped after 2 steps with a save at cp 2; the third step at cp 4 and at cp 1 (dp 8).
    ckpt = f"{out}/ckpt"
    save = ["training.exit_interval=2", f"checkpoint.save={ckpt!r}"]
    load = [f"checkpoint.load={ckpt!r}"]
    runs["first"] = train(_config(corpus, f"{out}/first", "llama", True, [*cp(2), *save]))
    runs["at-cp4"] = train(_config(corpus, f"{out}/at-cp4", "llama", True, [*cp(4), *load]))
    runs["at-cp1"] = train(_config(corpus, f"{out}/at-cp1", "llama", True, load))
    return runs


@pytest.fixture(scope="module")
def references(corpus, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("cp-one"))
    return run_distributed(_references, 1, args=(corpus, out), timeout=300)[0]


@pytest.fixture(scope="module")
def layouts(corpus, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("cp-layouts"))
    return run_distributed(_layouts, 8, args=(corpus, out), timeout=500)[0]


def test_every_context_parallel_layout_equals_one_process(references, layouts):
    for name, (model, packed, _) in LAYOUTS.items():
        assert_same_steps(layouts[name], references[(model, packed)], name, FP32_TOL)
    # The references differ: packed documents and the model change the steps.
    assert references[("gpt", True)]["loss"] != references[("gpt", False)]["loss"]
    assert references[("llama", True)]["loss"] != references[("gpt", True)]["loss"]
    assert references[("mla", True)]["loss"] != references[("llama", True)]["loss"]


def test_a_cp2_checkpoint_goes_on_at_cp4_and_cp1(references, layouts):
    reference = references[("llama", True)]
    first = layouts["first"]
    assert first["stopped_at"] == 2
    for name in ("at-cp4", "at-cp1"):
        run = layouts[name]
        steps = {k: first[k] + run[k] for k in ("loss", "grad_norm")}
        steps["valid"] = run["valid"]
        assert_same_steps(steps, reference, name, FP32_TOL)


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        (
            ["training.seq_length=20", *cp(4)],
            r"2 x cp = 8 equal chunks: training.seq_length \(20\)",
        ),
        (
            ["parallel.cp_comm_type='ring'"],
            r"parallel.cp_comm_type: expected one of p2p, allgather",
        ),
        (["model.kind='bert'", *cp(2)], "context parallelism here is for causal attention"),
        (["model.attention_dropout=0.1", *cp(2)], "has no dropout"),
        ([*cp(2), "training.cuda_graphs=true"], "not captured"),
        (
            [*cp(2, "latent")],
            r"parallel.cp_comm_type = 'latent' .* needs model.multi_latent_attention = true",
        ),
        ([*cp(3)], r"not divisible by parallel.tensor_model_parallel_size x context_parallel_size"),
    ],
)
def test_bad_context_parallel_configs_refused_naming_the_field(overrides, pattern):
    base = ["training.seq_length=24", "model.attention_dropout=0.0"]
    with pytest.raises(ConfigError, match=pattern):
        validate(load_config(None, [*base, *overrides]), 8)
