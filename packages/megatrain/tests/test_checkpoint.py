"""Checkpoints under real gloo groups: exact resume, layout changes, crashes mid-save, bad files."""

import os
import pickle
import shutil

import numpy as np
import pytest

from megacore.testing import DistributedTestError, run_distributed
from megatrain import checkpointing
from megatrain.checkpointing import CheckpointError, check_model_matches, find_checkpoint, read_meta
from megatrain.config import load_config
from megatrain.testing import random_documents, write_corpus
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
        return random_documents(rng, n, VOCAB, 10, 50)

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


def _killed_mid_save(corpus, out):
    """Saves at iterations 2 and 4; the process dies inside the second save."""
    import os

    import torch

    real_save = torch.save

    def dying_save(obj, path, *args, **kwargs):
        if "iter_0000004" in str(path):
            os._exit(9)  # after the weights and optimizer state, before meta.json and `latest`
        return real_save(obj, path, *args, **kwargs)

    torch.save = dying_save
    train(_config(corpus, out, "checkpoint.save_interval=2", f"checkpoint.save={out + '/ckpt'!r}"))


def _resume_after_kill(corpus, out):
    return train(_config(corpus, out + "/after", f"checkpoint.load={out + '/ckpt'!r}"))


@pytest.fixture(scope="module")
def killed_checkpoint(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("killed")
    with pytest.raises(DistributedTestError, match="exited with code 9"):
        run_distributed(_killed_mid_save, 2, args=(corpus, str(out)), timeout=120)
    resumed = run_distributed(_resume_after_kill, 2, args=(corpus, str(out)), timeout=120)[0]
    return out / "ckpt", resumed


def test_a_process_killed_mid_save_leaves_the_previous_checkpoint(killed_checkpoint):
    ckpt, resumed = killed_checkpoint
    assert (ckpt / "latest").read_text().strip() == "iter_0000002"
    assert (ckpt / ".tmp-iter_0000004" / "model" / ".metadata").is_file()  # half written
    assert not (ckpt / "iter_0000004").exists()
    assert len(resumed["loss"]) == 4  # iterations 3 to 6, from iteration 2


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_bad_checkpoints_are_refused_with_the_file(killed_checkpoint, tmp_path):
    from megatrain.models import GPTConfig

    ckpt, _ = killed_checkpoint
    no_latest = _copy(ckpt, tmp_path / "no-latest")
    (no_latest / "latest").unlink()
    with pytest.raises(CheckpointError, match=r"latest does not exist.*iter_0000002"):
        find_checkpoint(no_latest)
    gone = _copy(ckpt, tmp_path / "gone")
    shutil.rmtree(gone / "iter_0000002")
    with pytest.raises(
        CheckpointError, match=r"names 'iter_0000002', but .*meta.json does not exist"
    ):
        find_checkpoint(gone)
    cut = _copy(ckpt, tmp_path / "cut")
    shard = next((cut / "iter_0000002" / "model").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=rf"{shard.name} has 100 bytes, \d+ when saved"):
        find_checkpoint(cut)
    directory = find_checkpoint(ckpt)
    other = GPTConfig(num_layers=6, hidden_size=32, num_attention_heads=2, vocab_size=256,
                      max_position_embeddings=32)  # fmt: skip
    differs = r"another model \(num_layers: saved 4, here 6; num_attention_heads: saved 4, here 2\)"
    with pytest.raises(CheckpointError, match=differs):
        check_model_matches(read_meta(directory), other, VOCAB, directory)


def test_a_malicious_pickle_is_refused(killed_checkpoint, tmp_path):
    ckpt, _ = killed_checkpoint
    evil = _copy(ckpt, tmp_path / "evil")
    rng_file = evil / "iter_0000002" / "rng" / "rank-00000.pt"
    marker = tmp_path / "pwned"
    rng_file.write_bytes(pickle.dumps(_Exploit(str(marker)), protocol=2))
    with pytest.raises(CheckpointError, match="refusing to unpickle"):
        checkpointing._load_tensors(rng_file)
    assert not marker.exists()


class _Exploit:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def _sigterm_at_iteration_2(corpus, out):
    import signal

    import torch.distributed as dist

    from megatrain import training

    real_step = training.train_step

    def step(run):
        result = real_step(run)
        if run.iteration == 2 and dist.get_rank() == 1:  # one rank only: they must agree
            os.kill(os.getpid(), signal.SIGTERM)
        return result

    training.train_step = step
    return train(_config(corpus, out, f"checkpoint.save={out + '/ckpt'!r}"))


def test_sigterm_saves_then_stops(corpus, tmp_path):
    history = run_distributed(_sigterm_at_iteration_2, 2, args=(corpus, str(tmp_path)))[0]
    assert history["stopped_at"] == 2 and len(history["loss"]) == 2
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "iter_0000002"
    assert read_meta(find_checkpoint(tmp_path / "ckpt"))["iteration"] == 2
