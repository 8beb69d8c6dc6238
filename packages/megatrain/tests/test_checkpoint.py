"""Checkpoints under real gloo groups: exact resume, layout changes, crashes mid-save, bad files."""

import numpy as np
import pytest
from tiny_corpus import write_corpus

from megacore.testing import run_distributed
from megatrain.config import load_config
from megatrain.training import train

VOCAB = 200
BASE = [
    "model.num_layers=4",
    "model.hidden_size=32",
    "model.num_attention_heads=4",
    "model.max_position_embeddings=32",
    "model.make_vocab_size_divisible_by=64",
    "model.hidden_dropout=0.1",  # dropout on: the generators must resume too
    "model.attention_dropout=0.1",
    "training.seq_length=16",
    "training.micro_batch_size=2",
    "training.global_batch_size=8",
    "training.train_iters=6",
    "training.eval_interval=3",
    "training.eval_iters=1",
    "optimizer.lr=0.01",
    "optimizer.lr_warmup_iters=2",
    "logging.log_interval=1",
    "logging.tensorboard=false",
    "logging.peak_tflops=1.0",
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    rng = np.random.default_rng(3)

    def docs(n):
        return [[*rng.integers(1, VOCAB, rng.integers(10, 50)).tolist(), 0] for _ in range(n)]

    root = tmp_path_factory.mktemp("corpus")
    return str(
        write_corpus(root, {"train": [docs(50), docs(50)], "valid": [docs(20)]}, vocab_size=VOCAB)
    )


def _config(corpus, out, *overrides):
    return load_config(
        None, [*BASE, f"data.corpus={corpus!r}", f"training.output_dir={out!r}", *overrides]
    )


def _resume_runs(corpus, out):
    """Uninterrupted 6 steps against 3 steps, a save, and 3 more after loading."""
    results = {}
    for dist_opt in ("false", "true"):
        layout = [
            "parallel.tensor_model_parallel_size=2",
            f"parallel.use_distributed_optimizer={dist_opt}",
        ]
        ckpt = f"{out}/ckpt-{dist_opt}"
        full = train(_config(corpus, f"{out}/full-{dist_opt}", *layout))
        first = train(
            _config(corpus, f"{out}/first-{dist_opt}", *layout, "training.exit_interval=3",
                    f"checkpoint.save={ckpt!r}")
        )  # fmt: skip
        second = train(
            _config(corpus, f"{out}/second-{dist_opt}", *layout, f"checkpoint.load={ckpt!r}")
        )
        results[dist_opt] = (full, first, second)
    return results


def test_resume_is_exact(corpus, tmp_path):
    results = run_distributed(_resume_runs, 4, args=(corpus, str(tmp_path)), timeout=300)[0]
    for name, (full, first, second) in results.items():
        assert first["stopped_at"] == 3 and len(first["loss"]) == 3
        assert first["loss"] + second["loss"] == full["loss"], name  # bitwise
        assert first["grad_norm"] + second["grad_norm"] == full["grad_norm"], name
        assert second["valid"] == [v for v in full["valid"] if v[0] > 3], name
    assert (tmp_path / "ckpt-true" / "latest").read_text().strip() == "iter_0000003"


RESHARD = {  # the layouts a tp2-pp2-dp2 checkpoint (distributed optimizer) is loaded at
    "tp2-pp2-dp2": ["parallel.tensor_model_parallel_size=2",
                    "parallel.pipeline_model_parallel_size=2",
                    "parallel.use_distributed_optimizer=true"],
    "tp1-pp1-dp8-micro1": ["training.micro_batch_size=1"],
    "tp4-pp1-dp2-distopt": ["parallel.tensor_model_parallel_size=4",
                            "parallel.use_distributed_optimizer=true"],
    "tp1-pp4-dp2": ["parallel.pipeline_model_parallel_size=4"],
}  # fmt: skip
NO_DROPOUT = ["model.hidden_dropout=0.0", "model.attention_dropout=0.0"]


def _valid_loss_at_load(config):
    from megatrain import training

    device, _ = training.init_distributed()
    run = training.build_run(config, device)
    try:
        training.resume(run)
        return run.iteration, training.evaluate(run)
    finally:
        training.ps.destroy_model_parallel()


def _reshard_runs(corpus, out):
    ckpt = f"{out}/ckpt"
    saved = train(
        _config(corpus, f"{out}/save", *RESHARD["tp2-pp2-dp2"], *NO_DROPOUT,
                "training.exit_interval=3", f"checkpoint.save={ckpt!r}")
    )  # fmt: skip
    reference = train(_config(corpus, f"{out}/reference", *RESHARD["tp2-pp2-dp2"], *NO_DROPOUT))
    results = {}
    for name, layout in RESHARD.items():
        config = _config(corpus, f"{out}/{name}", *layout, *NO_DROPOUT, f"checkpoint.load={ckpt!r}")
        at_load = _valid_loss_at_load(config)
        results[name] = (at_load, train(config))
    return saved, reference, results


def test_checkpoint_loads_at_other_layouts(corpus, tmp_path):
    saved, reference, results = run_distributed(
        _reshard_runs, 8, args=(corpus, str(tmp_path)), timeout=400
    )[0]
    assert saved["valid"][-1][0] == 3
    for name, ((iteration, valid), resumed) in results.items():
        # The weights: the same validation loss as the saving run computed at iteration 3.
        assert iteration == 3 and abs(valid - saved["valid"][-1][1]) < 2e-5, name
        # The optimizer state: steps 4 to 6 as the uninterrupted run took them.
        for a, b in zip(resumed["loss"], reference["loss"][3:], strict=True):
            assert abs(a - b) < 2e-5, (name, resumed["loss"], reference["loss"])
        for a, b in zip(resumed["grad_norm"], reference["grad_norm"][3:], strict=True):
            assert abs(a - b) < 2e-5 * b, name
