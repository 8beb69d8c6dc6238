"""The end of a run whose background write was abandoned at its deadline, in worker processes
that made their own process group (as `megatrain run`'s and torchrun's workers do): the
teardown shuts down no group a writer still uses (`dist.destroy_process_group()` shuts every
group down), and each writer ends on its own at its next agreement, publishing nothing.

(gloo in torch 2.13 keeps serving a group after its shutdown, so the writer got through even
so; a backend whose shutdown aborts would have left it failing or waiting for good.)"""

import contextlib
import io
import multiprocessing
import os
import signal
import socket
import threading
import time

import torch.distributed as dist

from megacore.testing import run_distributed
from megatrain.checkpoint.background import FAULT_ENV
from megatrain.checkpoint.files import CheckpointError, find_checkpoint, read_meta
from megatrain.config import load_config
from megatrain.testing import QUIET_LOGGING, TINY_MODEL, write_counting_corpus

VOCAB = 200
SLEEP, DEADLINE = 12, 4  # rank 1's writer of iteration 2 pauses SLEEP s; the stop waits DEADLINE


def _latest(ckpt) -> int | None:
    try:
        return read_meta(find_checkpoint(ckpt))["iteration"]
    except CheckpointError:
        return None


def _writers() -> list[str]:
    """The background writers of this process still running (a thread or a process)."""
    threads = [t.name for t in threading.enumerate() if t.name.startswith("megatrain-checkpoint")]
    children = multiprocessing.active_children()
    return threads + [p.name for p in children if p.name.startswith("megatrain-checkpoint")]


@contextlib.contextmanager
def _writer_groups_shut_down_in_use():
    """Yields (the groups `AsyncSaver`s made in this process, those of them shut down while a
    writer ran)."""
    from megatrain.checkpoint import background

    made, in_use = [], []
    real_init, real_new_group = background.AsyncSaver.__init__, dist.new_group
    real_shutdown = dist.ProcessGroup.shutdown

    def init(self, *args, **kwargs):
        def new_group(*a, **k):
            made.append(real_new_group(*a, **k))
            return made[-1]

        dist.new_group = new_group
        try:
            real_init(self, *args, **kwargs)
        finally:
            dist.new_group = real_new_group

    def shutdown(group):
        if any(group is g for g in made) and _writers():
            in_use.append(group)
        return real_shutdown(group)

    background.AsyncSaver.__init__, dist.ProcessGroup.shutdown = init, shutdown
    try:
        yield made, in_use
    finally:
        background.AsyncSaver.__init__, dist.ProcessGroup.shutdown = real_init, real_shutdown


def _abandoned_then_torn_down(corpus, out):
    from megatrain.run import loop

    # This worker makes its own process group in `train`, which then tears it down.
    port = [None]
    if dist.get_rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port[0] = s.getsockname()[1]
    dist.broadcast_object_list(port, src=0)
    dist.destroy_process_group()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port[0]))
    ckpt = f"{out}/ckpt"
    real_step = loop.train_step

    def step(run, **kwargs):
        if run.iteration == 1:  # the deadline is for the write of 2: 1's is published first
            published = time.monotonic() + 120
            while _latest(ckpt) != 1 and time.monotonic() < published:
                time.sleep(0.05)
        result = real_step(run, **kwargs)
        if run.iteration == 2 and dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return result

    overrides = [
        *TINY_MODEL, *QUIET_LOGGING, "model.num_layers=2", "training.seq_length=16",
        "training.micro_batch_size=2", "training.global_batch_size=4", "training.train_iters=4",
        "training.eval_interval=1000", f"data.corpus={corpus!r}", f"training.output_dir={out!r}",
        f"checkpoint.save={ckpt!r}", "checkpoint.async_save=true", "checkpoint.save_interval=1",
        f"checkpoint.async_save_timeout={DEADLINE}",
    ]  # fmt: skip
    os.environ[FAULT_ENV] = f"writing:1:sleep{SLEEP}:2"
    loop.train_step, printed = step, io.StringIO()
    try:
        with contextlib.redirect_stdout(printed), _writer_groups_shut_down_in_use() as groups:
            loop.train(load_config(None, overrides))
            at_teardown = _writers()
    finally:
        loop.train_step = real_step
        del os.environ[FAULT_ENV]
    ended = time.monotonic()
    while _writers() and time.monotonic() < ended + SLEEP + 30:
        time.sleep(0.1)
    return {
        "abandoned": "megatrain: abandoned the background write of iteration 2"
        in printed.getvalue(),
        "at_teardown": at_teardown,
        "writer_groups": len(groups[0]),
        "shut_down_in_use": len(groups[1]),
        "left": _writers(),
        "latest": _latest(ckpt),
    }


def test_an_abandoned_write_ends_after_the_teardown(tmp_path):
    corpus = str(write_counting_corpus(tmp_path / "corpus", VOCAB))
    results = run_distributed(_abandoned_then_torn_down, 2, args=(corpus, str(tmp_path / "run")),
                              timeout=300)  # fmt: skip
    for rank, got in enumerate(results):
        assert got["shut_down_in_use"] == 0, (rank, got)
        assert got["left"] == [], (rank, got)  # every writer ended on its own
        assert got["latest"] == 1, (rank, got)  # the abandoned write published nothing
    assert results[0]["abandoned"], results[0]
    # Where the writers agree over a group of the training process (a writer thread), rank 1's
    # was still writing when its run ended: the case is there.
    assert results[1]["writer_groups"] == 0 or results[1]["at_teardown"], results[1]
