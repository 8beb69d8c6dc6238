"""BERT pretraining under real gloo process groups, against the same run in one process.

One 1-rank spawn trains the tiny BERT of both block orders (pre_ln: the paper's (b);
post_ln: the original (a)) for 3 steps; one 8-rank spawn trains the same at tensor,
pipeline (interleaved; uneven stages, one of them empty), data, sequence parallel layouts
with the distributed optimizer and full or selective recompute.  The masked-LM and SOP
losses, the gradient norms and the validation loss must equal the one-process run's;
every rank runs under NCCL's rules (run_distributed's default).  The corpus is real
English (Python's docstrings) tokenized as megadata's BERT corpora are: WordPiece with
sentence ends.
"""

import math

import pytest

from megacore.testing import run_distributed
from megatrain.config import load_config
from megatrain.run.loop import train
from megatrain.testing import TINY_MODEL, cuda_graphs_on_cpu, english_texts, write_bert_text_corpus

STEPS = 3
FP32_TOL = 2e-5  # as the GPT layouts: fp32 summation order only
ORDERS = ("pre_ln", "post_ln")
LAYOUTS = {
    "tp2-pp2-vpp2-dp2-seqpar-full": [
        "parallel.tensor_model_parallel_size=2",
        "parallel.pipeline_model_parallel_size=2",
        "parallel.virtual_pipeline_model_parallel_size=2",
        "parallel.sequence_parallel=true",
        'model.recompute="full"',
    ],
    "tp4-pp2-distopt-selective": [
        "parallel.tensor_model_parallel_size=4",
        "parallel.pipeline_model_parallel_size=2",
        "parallel.use_distributed_optimizer=true",
        'model.recompute="selective"',
    ],
    "tp2-pp2-dp2-zb-h1-distopt": [
        "parallel.tensor_model_parallel_size=2",
        "parallel.pipeline_model_parallel_size=2",
        'parallel.pipeline_schedule="zb-h1"',
        "parallel.use_distributed_optimizer=true",
    ],
    "pp4-dp2": ["parallel.pipeline_model_parallel_size=4"],
    "pp4-dp2-zb-h1-selective": [
        "parallel.pipeline_model_parallel_size=4",
        'parallel.pipeline_schedule="zb-h1"',
        'model.recompute="selective"',
    ],
    # Interleaved over four stages needs 8 layers: checked against an 8-layer reference.
    "pp4-vpp2-dp2-8-layers": [
        "model.num_layers=8",
        "parallel.pipeline_model_parallel_size=4",
        "parallel.virtual_pipeline_model_parallel_size=2",
    ],
    # Uneven stages (parallel.pipeline_model_parallel_layout) of 2, 3, none and 3 layers: the
    # third passes its input on, the last holds the pooler and both heads beside 3 layers.
    "pp4-dp2-uneven-8-layers": [
        "model.num_layers=8",
        "parallel.pipeline_model_parallel_size=4",
        'parallel.pipeline_model_parallel_layout="Ett|ttt||tttL"',
    ],
    # Each layer a CUDA graph (emulated on the CPU), the key-padding mask its second input.
    "graphs-tp2-dp4-seqpar": [
        "training.cuda_graphs=true",
        "parallel.tensor_model_parallel_size=2",
        "parallel.sequence_parallel=true",
    ],
    "dp8-distopt-overlap": [
        "parallel.use_distributed_optimizer=true",
        "parallel.overlap_param_gather=true",
    ],
}
# post_ln runs fewer layouts (the spawn's time): the ones that split its extra LayerNorms.
POST_LN_LAYOUTS = ("tp2-pp2-vpp2-dp2-seqpar-full", "dp8-distopt-overlap")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("bert-corpus")
    write_bert_text_corpus(root, english_texts(), vocab_size=1000)
    return str(root)


def _config(corpus, out, order, overrides=()):
    return load_config(
        None,
        [
            'model.kind="bert"',
            f"model.block_order={order!r}",
            f"data.corpus={corpus!r}",
            f"training.output_dir={out!r}",
            *TINY_MODEL,
            "training.seq_length=32",
            "training.micro_batch_size=2",
            "training.global_batch_size=16",
            f"training.train_iters={STEPS}",
            f"training.eval_interval={STEPS}",
            "training.eval_iters=2",
            "optimizer.lr=0.005",
            "optimizer.min_lr=0.0005",
            "optimizer.lr_warmup_iters=1",
            "logging.log_interval=1",
            "logging.tensorboard=false",
            "logging.peak_tflops=1.0",
            *overrides,
        ],
    )


def _one_process(corpus, out):
    runs = {order: train(_config(corpus, f"{out}/{order}", order)) for order in ORDERS}
    deep = ["model.num_layers=8"]
    runs["pre_ln-8-layers"] = train(_config(corpus, f"{out}/pre_ln-8", "pre_ln", deep))
    return runs


def _layouts(corpus, out):
    runs = {}
    with cuda_graphs_on_cpu():
        _train_layouts(corpus, out, runs)
    return runs


def _train_layouts(corpus, out, runs):
    for order in ORDERS:
        for name, overrides in LAYOUTS.items():
            if order == "post_ln" and name not in POST_LN_LAYOUTS:
                continue
            runs[order, name] = train(_config(corpus, f"{out}/{order}-{name}", order, overrides))


@pytest.fixture(scope="module")
def one_process(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("bert-one")
    return run_distributed(_one_process, 1, args=(corpus, str(out)), timeout=300)[0]


def test_bert_one_process_logs_both_losses(one_process):
    for order, run in one_process.items():
        assert len(run["loss"]) == len(run["mlm_loss"]) == len(run["sop_loss"]) == STEPS
        for loss, mlm, sop in zip(run["loss"], run["mlm_loss"], run["sop_loss"], strict=True):
            assert loss == pytest.approx(mlm + sop, abs=1e-5)
            assert 0.3 < sop < 1.2, (order, run["sop_loss"])  # about ln 2 at the start
        # The masked LM starts near ln(vocabulary) and its steps lower it.
        assert run["mlm_loss"][0] > math.log(1000) - 1.0, (order, run["mlm_loss"])
        assert run["mlm_loss"][-1] < run["mlm_loss"][0], (order, run["mlm_loss"])
        assert 0.0 <= run["sop_accuracy"][0] <= 1.0
    # The two block orders are different functions of the same weights.
    assert one_process["pre_ln"]["loss"][0] != one_process["post_ln"]["loss"][0]


def test_bert_layouts_match_one_process(corpus, one_process, tmp_path):
    runs = run_distributed(_layouts, 8, args=(corpus, str(tmp_path)), timeout=600)[0]
    assert len(runs) == len(LAYOUTS) + len(POST_LN_LAYOUTS)
    for (order, name), run in runs.items():
        reference = one_process[f"{order}-8-layers" if "8-layers" in name else order]
        for key in ("loss", "mlm_loss", "sop_loss"):
            for a, b in zip(run[key], reference[key], strict=True):
                assert abs(a - b) < FP32_TOL, (order, name, key, run[key], reference[key])
        for a, b in zip(run["grad_norm"], reference["grad_norm"], strict=True):
            assert abs(a - b) < FP32_TOL * b, (order, name, run["grad_norm"])
        (it, valid), (ref_it, ref_valid) = run["valid"][-1], reference["valid"][-1]
        assert it == ref_it == STEPS and abs(valid - ref_valid) < FP32_TOL, (order, name)


def _resume_and_reshard(corpus, out):
    """post_ln (its embedding LayerNorm too) at tp2-dp2 with the distributed optimizer:
    6 steps straight; 3 steps, a save, 3 more after loading at the same layout; and 3
    more after loading at pp2-dp2."""
    ckpt = f"{out}/ckpt"
    tp2 = [
        "parallel.tensor_model_parallel_size=2",
        "parallel.use_distributed_optimizer=true",
        "training.train_iters=6",
        "training.eval_interval=3",
    ]
    pp2 = ["parallel.pipeline_model_parallel_size=2", *tp2[2:]]
    full = train(_config(corpus, f"{out}/full", "post_ln", tp2))
    saving = [*tp2, "training.exit_interval=3", f"checkpoint.save={ckpt!r}"]
    first = train(_config(corpus, f"{out}/first", "post_ln", saving))
    second = train(_config(corpus, f"{out}/second", "post_ln", [*tp2, f"checkpoint.load={ckpt!r}"]))
    moved = train(_config(corpus, f"{out}/pp2", "post_ln", [*pp2, f"checkpoint.load={ckpt!r}"]))
    return full, first, second, moved


def test_bert_resumes_bitwise_and_reshards(corpus, tmp_path):
    full, first, second, moved = run_distributed(
        _resume_and_reshard, 4, args=(corpus, str(tmp_path)), timeout=300
    )[0]
    assert first["stopped_at"] == 3
    for key in ("loss", "mlm_loss", "sop_loss", "grad_norm"):
        assert first[key] + second[key] == full[key], key  # bitwise
    assert second["valid"] == [v for v in full["valid"] if v[0] > 3]
    for key in ("loss", "mlm_loss", "sop_loss"):
        for a, b in zip(moved[key], full[key][3:], strict=True):
            assert abs(a - b) < FP32_TOL, (key, moved[key], full[key])
