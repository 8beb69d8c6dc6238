"""The training stall at a checkpoint save on the CPU, written at once against in the
background (`checkpoint.async_save`): a GPT whose state takes seconds to write, dp 2 under
the distributed optimizer.

    python benchmarks/bench_async_checkpoint.py --out benchmarks/results/async-checkpoint-cpu.json

On 2 gloo ranks: `--steps` steps without a save (the step time); a synchronous save, timed
(the second one: DCP's first call sets itself up); then twice a background save and `--steps`
steps beside its writer, and the wait for its end (where the next save or the end of the run
waits).  The stall is the time training is blocked: the synchronous save's whole write, or
the background save's host copy and that wait; the steps beside the writer are timed against
the steps just before (on two cores the writer processes compete with the training for
them).  The writer processes are started and joined before anything is timed (a run starts
them with the saver, before its first save).  The first background save allocates the host
buffer, the second ("async") reuses it as a run's later saves do; a third times a
pure-Python loop in each training process beside its writer's write against the loop alone
(`loop_rate_beside_write`, the lower rank's).  `gil_probe`: a pure-Python loop's rate while
512 MB are written as DCP writes them, in a thread of the same process (the writer before
issue 61) and in another process, against its rate alone (the median of three), the loop
on one core and the write on another.  The
checkpoint goes to --dir (a disk, not a tmpfs: the write has to take its time); DCP fsyncs
every file.  The NCCL-rules checker is off (right for tests, not timing).
"""

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megacore import parallel_state as ps
from megacore.testing import run_distributed
from megatrain.checkpoint.background import AsyncSaver
from megatrain.checkpoint.save import save_checkpoint
from megatrain.config import load_config
from megatrain.run.distributed import init_distributed
from megatrain.run.setup import build_run
from megatrain.run.step import train_step
from megatrain.testing import write_counting_corpus

VOCAB = 512


def _overrides(args, corpus: str, out: str) -> list[str]:
    return [
        f"data.corpus={corpus!r}",
        f"training.output_dir={out!r}",
        f"model.num_layers={args.layers}",
        f"model.hidden_size={args.hidden}",
        "model.num_attention_heads=8",
        f"model.max_position_embeddings={args.seq}",
        f"training.seq_length={args.seq}",
        "training.micro_batch_size=1",
        "training.global_batch_size=2",
        "parallel.use_distributed_optimizer=true",
        "training.train_iters=1000",
        "logging.tensorboard=false",
    ]


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _steps(run, n: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(n):
        train_step(run)
    return time.perf_counter() - start


def _measure(overrides: list[str], ckpt: str, steps: int) -> dict:
    device, _ = init_distributed(600)
    run = build_run(load_config(None, overrides), device)
    try:
        train_step(run)  # warm-up: Adam's moments exist from here on
        result = {"step_ms": _slowest(_steps(run, steps)) / steps * 1e3}
        # Synchronous: the save is the stall (the second one: DCP's first call sets itself up).
        save_checkpoint(run, f"{ckpt}/sync", keep=1)
        train_step(run)
        dist.barrier()
        start = time.perf_counter()
        save_checkpoint(run, f"{ckpt}/sync", keep=1)
        result["sync_stall_s"] = _slowest(time.perf_counter() - start)
        # In the background: the copy and the wait for the write's end block training; the
        # steps beside the writer go on, at their own pace against the steps just before.
        # Twice: the first save allocates the host buffers, the second (reported as "async")
        # reuses them, as every later save of a run does.
        saver = AsyncSaver(f"{ckpt}/async", 1, 600)
        saver.ready()  # its writer process started and joined its peers: not a save's stall
        for key in ("async_first", "async"):
            before_ms = _slowest(_steps(run, steps)) / steps * 1e3
            dist.barrier()
            start = time.perf_counter()
            saver.save(run)
            copy_s = time.perf_counter() - start
            beside_s = _steps(run, steps)
            written_before_wait = saver.over()
            wait_start = time.perf_counter()
            saver.wait()
            wait_s = time.perf_counter() - wait_start
            result.update({
                f"{key}_stall_s": _slowest(copy_s + wait_s),
                f"{key}_copy_s": _slowest(copy_s),
                f"{key}_wait_s": _slowest(wait_s),
                f"{key}_step_ms_before": before_ms,
                f"{key}_step_ms_beside_write": _slowest(beside_s) / steps * 1e3,
                f"{key}_written_during_the_steps": written_before_wait,
            })  # fmt: skip
        # A pure-Python loop in the training process beside the writer process's write, against
        # the loop alone for as long: what the write takes from the training's interpreter.
        dist.barrier()
        saver.save(run)
        start = time.perf_counter()
        beside = _loop_rate(saver.over)
        write_s = time.perf_counter() - start
        saver.wait()
        alone_start = time.perf_counter()
        alone = _loop_rate(lambda: time.perf_counter() - alone_start > write_s)
        result["loop_rate_beside_write"] = -_slowest(-beside / alone)  # the rank that lost most
        result["host_copy_bytes"] = saver.host.nbytes()
        saver.close()
        files = [f for f in Path(f"{ckpt}/sync").glob("iter_*/**/*") if f.is_file()]
        result["checkpoint_bytes"] = sum(f.stat().st_size for f in files)
        return result
    finally:
        ps.destroy_model_parallel()


def _loop_rate(done) -> float:
    """Iterations per second of a pure-Python loop (it needs the GIL all the time) until
    `done()`, asked every 4096 iterations."""
    n, start = 0, time.perf_counter()
    while n % 4096 or not done():
        n += 1
    return n / (time.perf_counter() - start)


def _python_rate(seconds: float, until=None) -> float:
    """Iterations per second of a pure-Python loop: it needs the GIL all the time."""
    n, start = 0, time.perf_counter()
    while (time.perf_counter() - start < seconds) if until is None else until():
        n += 1
    return n / (time.perf_counter() - start)


def _rate_to(conn, seconds: float, cpus: set) -> None:
    os.sched_setaffinity(0, cpus)
    conn.send(_python_rate(seconds))


def gil_probe(mb: int, directory: str) -> dict:
    """A pure-Python loop (it needs the GIL all the time) beside a write of `mb` MB of host
    tensors as the writer does it (DCP, every file fsynced), against the loop alone: the loop
    in the writing process (the writer a thread: the GIL shared) and in another process (as
    the writer process is).  The loop runs on one core and the write on another (affinity,
    with two cores or more), so other jobs' load weighs on both sides alike and what differs
    is the interpreter lock.  Equal ratios: the write leaves the GIL to the loop."""
    import multiprocessing as mp
    import threading
    import warnings

    import torch.distributed.checkpoint as dcp

    every = sorted(os.sched_getaffinity(0))
    loop_cpu, write_cpu = {every[0]}, {every[-1]}  # one core each (the same one on one core)
    on = lambda cpus: os.sched_setaffinity(0, cpus)  # noqa: E731  (Linux: this thread only)
    state = {f"t{i}": torch.randn(mb * 2**20 // 4 // 16) for i in range(16)}
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that it runs without a process group
        for trial in range(3):
            path = f"{directory}/{trial}"
            write = lambda name: dcp.save(state, checkpoint_id=f"{path}/{name}", no_dist=True)  # noqa: E731, B023
            on(loop_cpu)
            alone = _python_rate(1.0)
            thread = threading.Thread(target=lambda w=write: (on(write_cpu), w("thread")))
            start = time.perf_counter()
            thread.start()
            same = _python_rate(0, until=thread.is_alive)
            write_s = time.perf_counter() - start
            ours, theirs = mp.get_context("fork").Pipe()
            child = mp.get_context("fork").Process(
                target=_rate_to, args=(theirs, write_s, loop_cpu)
            )
            child.start()
            on(write_cpu)
            write("process")
            other = ours.recv()
            child.join()
            rows.append((write_s, same / alone, other / alone))
    on(set(every))
    write_s, same, other = (sorted(column)[1] for column in zip(*rows, strict=True))
    return {
        "mb": mb,
        "write_s": write_s,
        "loop_rate_beside_write_same_process": same,
        "loop_rate_beside_write_other_process": other,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--gil-probe-mb", type=int, default=512)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary one)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        corpus = str(write_counting_corpus(Path(tmp), VOCAB))
        overrides = _overrides(args, corpus, f"{tmp}/run")
        ranks = run_distributed(
            _measure, 2, (overrides, f"{tmp}/ckpt", args.steps), timeout=1800, nccl_rules=False
        )
        shutil.rmtree(f"{tmp}/ckpt", ignore_errors=True)
        gil = gil_probe(args.gil_probe_mb, f"{tmp}/gil")
    row = ranks[0]
    row["host_copy_bytes_per_rank"] = [r["host_copy_bytes"] for r in ranks]
    del row["host_copy_bytes"]
    row["stall_ratio"] = row["async_stall_s"] / row["sync_stall_s"]
    beside = row["async_step_ms_beside_write"] / row["async_step_ms_before"]
    row["steps_beside_write_ratio"] = beside
    result = {
        "benchmark": "async-checkpoint-cpu",
        "dp": 2,
        "args": vars(args),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "cpus": len(os.sched_getaffinity(0)),
        "results": {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()},
        "gil_probe": {k: round(v, 4) for k, v in gil.items()},
    }
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
