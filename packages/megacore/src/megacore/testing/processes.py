"""Run a function on N ranks of a real torch.distributed process group, for tests.

Every multi-process test of the suite goes through `run_distributed`:

    def _sum_ranks():
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t)
        return t.item()

    def test_sum():
        assert run_distributed(_sum_ranks, world_size=4) == [6.0] * 4

It starts one process per rank (forked from a fork server that imported torch once, so a
rank costs milliseconds rather than seconds of imports), joins them into one process group (gloo by
default) through a TCPStore that this process hosts on a port the OS picks (so
parallel test runs never race for a port), calls the function on every rank
(held to NCCL's rules by `nccl_semantics`, see nccl.py) and returns the
results in rank order.  If a rank raises, or dies, the call
raises `DistributedTestError` with that rank's traceback, after stopping the
other ranks (which would otherwise wait forever in their next collective).  If
the ranks do not all finish within `timeout` seconds, they are stopped and the
error shows where each unfinished rank was.

The function must be defined at the top level of a module; its arguments and
return value must pickle.  Test modules need not be on sys.path: a rank finds
the function's module from its file path when the name alone does not import
(as under pytest's importlib import mode).
"""

import contextlib
import faulthandler
import importlib
import multiprocessing as mp
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megacore.testing.nccl import nccl_semantics

_HOST = "127.0.0.1"
# After the first rank fails, how long the others get to report their own errors.
_GRACE_S = 2.0
# How long a stopped rank gets to write its stack before it is killed.
_STACK_DUMP_S = 1.0


class DistributedTestError(RuntimeError):
    """A rank raised, died or did not finish in time; the message says which and why."""


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    kwargs: dict | None = None,
    *,
    timeout: float = 180.0,
    backend: str = "gloo",
    nccl_rules: bool = True,
) -> list[Any]:
    """Call `fn(*args, **kwargs)` on `world_size` spawned ranks; return their results by rank.

    Each rank sees an initialized default process group (`dist.get_rank()`,
    `dist.get_world_size()`), the RANK/WORLD_SIZE/LOCAL_RANK environment
    variables, and an equal share of the CPU cores for torch threads.  With
    backend="nccl" each rank also gets `torch.cuda.set_device(rank % devices)`.
    With `nccl_rules` (the default) the function runs inside `nccl_semantics()`,
    so gloo refuses what NCCL would hang on or refuse.
    """
    if world_size < 1:
        raise ValueError(f"run_distributed: world_size must be >= 1, got {world_size}")
    payload = _pickle_call(fn, args, kwargs or {})
    module = sys.modules.get(fn.__module__)
    module_file = getattr(module, "__file__", None)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = max(1, (cores or 1) // world_size)

    store = dist.TCPStore(_HOST, 0, None, True, timedelta(seconds=timeout), wait_for_workers=False)
    launch = _Launch(
        world_size, store.port, backend, timeout, threads, fn.__module__, module_file, nccl_rules,
        dict(os.environ),
    )  # fmt: skip
    ctx = _context()
    ranks: list[_Rank] = []
    with tempfile.TemporaryDirectory(prefix="run_distributed_") as tmp:
        try:
            for rank in range(world_size):
                parent_end, child_end = ctx.Pipe(duplex=False)
                stack_file = Path(tmp) / f"rank{rank}.stack"
                process = ctx.Process(
                    target=_rank_main,
                    name=f"rank{rank}",
                    args=(rank, launch, payload, child_end, str(stack_file)),
                )
                process.start()
                child_end.close()  # so a rank that dies shows as end-of-file on parent_end
                ranks.append(_Rank(rank, process, parent_end, stack_file))
            _collect(ranks, time.monotonic() + timeout)
        finally:
            _stop(ranks)
    del store  # free the port now: a raised error keeps this frame, and so the store, alive

    name = f"{fn.__module__}.{fn.__qualname__}"
    # A rank that died has no time of its own; a hard death is nearly always the cause.
    failed = sorted((r for r in ranks if r.error), key=lambda r: (not r.died, r.failed_at))
    if failed:
        raise DistributedTestError(_failure_report(name, world_size, failed, ranks))
    unfinished = [r for r in ranks if not r.finished]
    if unfinished:
        raise DistributedTestError(_timeout_report(name, world_size, timeout, unfinished, ranks))
    return [r.result for r in ranks]


# Imported once by the fork server instead of by every rank: `import torch` and megatrain cost
# seconds of CPU a rank, which an 8-rank test on 2 cores pays 8 times over.  A name that does
# not import here (megacore installed alone) is skipped by the fork server.
_PRELOAD = ["torch", "torch.distributed", "megacore.testing.processes", "megatrain.run.loop"]


def _context():
    """A fork server: each rank is forked from one clean process that has imported _PRELOAD, so
    it starts in milliseconds, yet like a spawned rank it inherits no state (no threads, no
    process group, nothing of the parent test); `_rank_main` then takes the parent's
    environment and working directory as they are at this call."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


@dataclass(frozen=True)
class _Launch:
    """What every spawned rank needs to know to join the group and find the function."""

    world_size: int
    port: int
    backend: str
    timeout: float
    threads: int
    module_name: str
    module_file: str | None
    nccl_rules: bool
    environ: dict  # the parent's, now: the fork server kept the one it started with


@dataclass
class _Rank:
    """The parent's view of one spawned rank."""

    rank: int
    process: mp.process.BaseProcess
    conn: Connection
    stack_file: Path
    finished: bool = False
    result: Any = None
    error: str | None = None
    failed_at: float = 0.0  # the rank's own clock when it failed
    died: bool = False  # exited without a report
    stack: str = ""  # where it was when stopped after a timeout


def _pickle_call(fn: Callable, args: tuple, kwargs: dict) -> bytes:
    try:
        return pickle.dumps((fn, args, kwargs))
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        raise TypeError(
            f"run_distributed: {fn!r} and its arguments must pickle so that spawned ranks can "
            f"receive them; define the function at the top level of a module ({e})"
        ) from e


def _collect(ranks: list[_Rank], deadline: float) -> None:
    """Read each rank's report until all are in, one failed (plus a grace period), or time is up."""
    pending = {r.conn: r for r in ranks}
    stop_at = deadline
    while pending:
        remaining = stop_at - time.monotonic()
        if remaining <= 0:
            return
        for conn in wait(list(pending), timeout=remaining):
            r = pending.pop(conn)
            try:
                status, value = pickle.loads(conn.recv_bytes())
            except EOFError:  # exited without a report: a crash, os._exit, a signal
                r.process.join(_STACK_DUMP_S)
                r.died = True
                status, value = "error", (_describe_exit(r.process.exitcode), time.time())
            if status == "ok":
                r.finished, r.result = True, value
            else:
                # Order failures by when the rank hit them, not by when we read them.
                r.error, r.failed_at = value
                stop_at = min(stop_at, time.monotonic() + _GRACE_S)


def _describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        return f"the process was killed by signal {signal.Signals(-code).name} before reporting\n"
    return f"the process exited with code {code} before reporting\n"


def _stop(ranks: list[_Rank]) -> None:
    """End every rank; after a timeout (no rank failed) first dump where unfinished ones are."""
    running = [r for r in ranks if r.process.is_alive() and not r.finished]
    timed_out = not any(r.error for r in ranks)
    if running and timed_out and hasattr(signal, "SIGUSR1"):
        for r in running:
            os.kill(r.process.pid, signal.SIGUSR1)
        time.sleep(_STACK_DUMP_S)
        for r in running:
            r.stack = _user_frames(r.stack_file.read_text()) if r.stack_file.exists() else ""
    for r in ranks:
        if r.finished:
            r.process.join(10)  # it has reported; let it leave the group and exit on its own
        if r.process.is_alive():
            r.process.terminate()
            r.process.join(5)
        if r.process.is_alive():
            r.process.kill()
            r.process.join()
        r.conn.close()


def _user_frames(dump: str) -> str:
    """A faulthandler dump without the frames of this harness and of multiprocessing below it."""
    kept, skipping = [], False
    for line in dump.splitlines():
        if line.startswith(("Thread ", "Current thread ")):
            skipping = False
        elif "in _rank_main" in line:
            skipping = True
        if not skipping:
            kept.append(line)
    return "\n".join(kept)


def _others(ranks: list[_Rank], shown: list[_Rank]) -> str:
    done = [str(r.rank) for r in ranks if r.finished]
    stopped = [str(r.rank) for r in ranks if not r.finished and r not in shown]
    parts = []
    if done:
        parts.append(f"ranks finished: {', '.join(done)}")
    if stopped:
        parts.append(f"ranks stopped while still running: {', '.join(stopped)}")
    return "; ".join(parts)


def _failure_report(name: str, world_size: int, failed: list[_Rank], ranks: list[_Rank]) -> str:
    first, later = failed[0], failed[1:]
    lines = [f"{name} failed on rank {first.rank} of {world_size}:", first.error.rstrip()]
    if later:
        # Peers of a failed rank usually fail next in their collectives; one line each is enough.
        lines.append("Then, often as a consequence, these ranks failed too:")
        lines += [f"  rank {r.rank}: {r.error.rstrip().splitlines()[-1]}" for r in later]
    others = _others(ranks, failed)
    if others:
        lines.append(f"({others})")
    return "\n".join(lines)


def _timeout_report(
    name: str, world_size: int, timeout: float, unfinished: list[_Rank], ranks: list[_Rank]
) -> str:
    which = ", ".join(str(r.rank) for r in unfinished)
    lines = [
        f"{name} timed out after {timeout:g} s on {world_size} ranks: rank(s) {which} did not "
        "finish. Where each was when stopped (most recent call first):"
    ]
    for r in unfinished:
        stack = r.stack.rstrip() or "(no stack: the rank was still starting up)"
        lines += [f"--- rank {r.rank} ---", stack]
    finished = _others(ranks, unfinished)
    if finished:
        lines.append(f"({finished})")
    return "\n".join(lines)


# ---- inside a spawned rank -------------------------------------------------------------


def _rank_main(rank: int, launch: _Launch, payload: bytes, conn: Connection, stack_file: str):
    # Kept open for the life of the process: faulthandler writes to its descriptor.
    stack_out = open(stack_file, "w")  # noqa: SIM115
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=stack_out, all_threads=True)
    os.environ.clear()
    os.environ.update(launch.environ)
    # What torchrun would set, for code under test that reads it.
    n, r = str(launch.world_size), str(rank)
    os.environ.update(RANK=r, WORLD_SIZE=n, LOCAL_RANK=r, LOCAL_WORLD_SIZE=n)
    torch.set_num_threads(launch.threads)
    timeout = timedelta(seconds=launch.timeout)
    try:
        _import_defining_module(launch.module_name, launch.module_file)
        fn, args, kwargs = pickle.loads(payload)
        store = dist.TCPStore(_HOST, launch.port, None, False, timeout)
        if launch.backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(
            launch.backend, store=store, rank=rank, world_size=launch.world_size, timeout=timeout
        )
        with nccl_semantics() if launch.nccl_rules else contextlib.nullcontext():
            report = ("ok", fn(*args, **kwargs))
    except BaseException:
        report = ("error", (traceback.format_exc(), time.time()))
    try:
        # Plain pickle: tensors travel by value.  conn.send would pass their storage as file
        # descriptors that the parent fetches from this process later, after it may have exited.
        conn.send_bytes(pickle.dumps(report))
    except Exception:
        error = f"the rank's return value cannot be sent back:\n{traceback.format_exc()}"
        conn.send_bytes(pickle.dumps(("error", (error, time.time()))))
    finally:
        conn.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _import_defining_module(name: str, file: str | None) -> None:
    """Make `name` importable here so that pickled references into it resolve."""
    if name in sys.modules or name == "__main__":
        return
    try:
        importlib.import_module(name)
        return
    except ImportError:
        if file is None:
            raise
    # pytest's importlib mode names a test module after its path below the root dir
    # (packages.megacore.tests.test_x) without putting that root on sys.path.
    path = Path(file).resolve()
    stem = path.parent.parts if path.name == "__init__.py" else path.with_suffix("").parts
    parts = tuple(name.split("."))
    if stem[-len(parts) :] != parts:
        raise ImportError(f"run_distributed: module {name!r} does not import by name, and its "
                          f"file {file} is not at a path that matches the name")  # fmt: skip
    sys.path.append(str(Path(*stem[: -len(parts)])))
    importlib.import_module(name)
