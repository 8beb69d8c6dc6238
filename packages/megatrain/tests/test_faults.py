"""Faults a long run meets, each injected for real: a disk that fills during a checkpoint
save, a corrupted corpus shard, a loss that turns NaN, a checkpoint directory that cannot be
written.  Each is caught with a message naming what and where, before or without losing work.
"""

import json
import os
import resource
import shutil
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from megacore.optimizer import NonFiniteLossError
from megacore.testing import run_distributed
from megatrain.checkpoint.files import CheckpointError, find_checkpoint, read_meta
from megatrain.cli import main
from megatrain.config import load_config
from megatrain.run import launch
from megatrain.run.loop import train
from megatrain.testing import random_documents, write_corpus

TINY = Path(__file__).resolve().parents[3] / "pipelines" / "models" / "gpt2-tiny.toml"
VOCAB = 200
FILE_LIMIT = 64 * 1024  # bytes a file may grow to on the "full disk": below the model's shard


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    rng = np.random.default_rng(3)
    root = tmp_path_factory.mktemp("corpus")
    docs = lambda n: random_documents(rng, n, VOCAB, 30, 90)  # noqa: E731
    return write_corpus(
        root, {"train": [docs(30), docs(30)], "valid": [docs(10)]}, vocab_size=VOCAB
    )


def _overrides(corpus, out, *extra):
    return [
        f"data.corpus={str(corpus)!r}", f"training.output_dir={str(out)!r}",
        "model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4",
        "model.max_position_embeddings=32", "training.seq_length=16",
        "training.micro_batch_size=2", "training.global_batch_size=4",
        "training.eval_interval=1000", "training.eval_iters=1", "logging.log_interval=1",
        "logging.tensorboard=false", "logging.peak_tflops=1.0", *extra,
    ]  # fmt: skip


def _config(corpus, out, *extra):
    return load_config(None, _overrides(corpus, out, *extra))


def _save_on_a_full_disk(corpus, out):
    ckpt = f"{out}/ckpt"
    resume = (f"checkpoint.save={ckpt!r}", f"checkpoint.load={ckpt!r}")
    train(_config(corpus, out, "training.train_iters=2", *resume))
    # Files may not grow past FILE_LIMIT: writing the next checkpoint's shards fails (EFBIG),
    # as on a full disk or quota.  SIGXFSZ would kill the process; the write fails instead.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_LIMIT, hard))
    try:
        train(_config(corpus, out, "training.train_iters=4", *resume))
        error = None
    except CheckpointError as e:
        error = str(e)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    latest_after_failure = read_meta(find_checkpoint(ckpt))["iteration"]
    # Room again: the run resumes from the checkpoint the failed save left standing.
    history = train(_config(corpus, out, "training.train_iters=4", *resume))
    return error, latest_after_failure, len(history["loss"]), read_meta(find_checkpoint(ckpt))


def test_a_disk_full_during_a_save_names_the_path_and_the_last_checkpoint_stands(corpus, tmp_path):
    error, standing, resumed_steps, final = run_distributed(
        _save_on_a_full_disk, 1, args=(corpus, str(tmp_path)), timeout=240
    )[0]
    ckpt = tmp_path / "ckpt"
    assert error is not None, "the save into a full disk did not fail"
    assert error.startswith(f"saving iteration 4 to {ckpt / '.tmp-iter_0000004'} failed: ")
    assert "File too large" in error and f"the last complete checkpoint in {ckpt}" in error
    assert standing == 2  # `latest` still names iteration 2, whole (find_checkpoint checks)
    assert resumed_steps == 2 and final["iteration"] == 4


def _diverge(corpus, out):
    try:
        diverging = ("optimizer.lr=1e30", "optimizer.lr_warmup_iters=0")
        train(_config(corpus, out, "training.train_iters=20", "training.max_nonfinite_losses=2",
                      *diverging))  # fmt: skip
    except NonFiniteLossError as e:
        return str(e)
    return None


def test_a_loss_that_turns_nan_halts_the_run_naming_the_steps(corpus, tmp_path):
    message = run_distributed(_diverge, 1, args=(corpus, str(tmp_path)), timeout=240)[0]
    assert message is not None, "a learning rate of 1e30 did not make the loss non-finite"
    assert message.startswith("stopping at step ") and "2 steps in a row" in message


def _refused_before_workers(monkeypatch, args):
    def no_workers(*a, **k):
        raise AssertionError("workers started")

    monkeypatch.setattr(launch, "launch", no_workers)
    result = CliRunner().invoke(main, ["run", "--config", str(TINY), *args])
    assert result.exit_code == 2, result.output
    return result.output


def test_a_corrupted_shard_is_found_by_its_sha256_before_training(corpus, tmp_path, monkeypatch):
    copy = tmp_path / "corpus"
    shutil.copytree(corpus, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    shard = copy / manifest["splits"]["train"]["shards"][1]["file"]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte: the same size, other tokens
    shard.write_bytes(bytes(data))
    output = _refused_before_workers(monkeypatch, _overrides(copy, tmp_path / "out"))
    assert f"{shard}: sha256" in output and "splits.train.shards[1].sha256" in output


def _make_read_only(directory) -> None:
    """chmod for a user; root writes anyway, so the immutable attribute, where it can be set."""
    directory.chmod(0o555)
    if os.geteuid() == 0:
        subprocess.run(["chattr", "+i", str(directory)], check=False, capture_output=True)


def test_a_read_only_checkpoint_directory_is_refused_before_training(corpus, tmp_path, monkeypatch):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    _make_read_only(ckpt)
    try:
        if (os.access(ckpt, os.W_OK) and os.geteuid() != 0) or _writable(ckpt):
            # Neither way works on this filesystem: refuse the probe's write as the OS would.
            import tempfile

            def refuse(*a, dir=None, **k):
                raise PermissionError(30, "Read-only file system", str(dir))

            monkeypatch.setattr(tempfile, "TemporaryFile", refuse)
        args = [*_overrides(corpus, tmp_path / "out"), "--save", str(ckpt)]
        output = _refused_before_workers(monkeypatch, args)
        assert f"checkpoint.save (--save) {ckpt}: cannot write there (" in output
    finally:
        subprocess.run(["chattr", "-i", str(ckpt)], check=False, capture_output=True)
        ckpt.chmod(0o755)


def _writable(directory) -> bool:
    probe = directory / "probe"
    try:
        probe.write_text("x")
    except OSError:
        return False
    probe.unlink()
    return True
