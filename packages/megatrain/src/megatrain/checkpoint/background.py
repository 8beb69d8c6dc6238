"""Checkpoints written in the background (`checkpoint.async_save = true`): the training side.

At a save step each rank copies its share of the state (`save.snapshot`: the weights, the
optimizer's shards as they are, the generators, the data position; nothing gathered) into
one host buffer of its own (`HostCopy`: exactly its bytes, shared memory, pinned on CUDA,
kept from one save to the next), hands the copy to its writer process and goes on
training; the writer (writer.py) writes it through the path a synchronous save takes:
`.tmp-iter_N/`, every file checked, `publish` (meta.json, the rename, `latest`).

A process, not a thread: a thread of the training process shares its interpreter lock, and
the write holds it part of the time (DCP's planning and serialisation are Python), which a
pure-Python loop beside a write measures (benchmarks/bench_async_checkpoint.py); on a GPU
the training loop's kernel launches are Python too.  The process is started once (spawn)
when the saver is made and shares the host buffer, so a save hands over the buffer's
offsets, not its bytes (as Megatron-LM's persistent worker and DCP's process-based
checkpointer do).

The writers agree among themselves over a gloo group of their own, made in the writer
processes from the job's TCPStore under a key prefix rank 0 draws: each phase ends in an
all-gather of every rank's outcome (an empty tmp directory; every rank's files written; rank
0's `publish`), so every rank learns the same outcome at the same phase, and `latest` moves
only after every rank's files are complete.  The training process collects the outcome at
the next save (which first waits for the previous one), at a stop and at the end of training,
points every rank reaches at the same iteration: a failed write raises the same
`CheckpointError` on every rank there (a writer that died: its rank says so, the others
that their writers lost a peer).  `AsyncSaver` is that side of it, one state machine (idle,
writing, abandoned, closed) whose transitions the training loop calls.
"""

import contextlib
import ctypes
import multiprocessing as mp
import os
import signal
import time
import uuid
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from megatrain.checkpoint import save as saving
from megatrain.checkpoint.dcp import Pieces
from megatrain.checkpoint.files import CheckpointError, find_checkpoint, iteration_dir, read_meta
from megatrain.checkpoint.writer import FAULT_ENV, Writer, carried, fault, serve, view


def _local_tensors(name: str, state: dict):
    """(key, tensor) of every tensor of `state` that `HostCopy.state` copies, in its order."""
    for key, value in state.items():
        if isinstance(value, Pieces):
            for o, t in value._pieces.items():
                yield (name, key, tuple(o)), t
        elif isinstance(value, DTensor):
            yield (name, key), value.to_local()
        elif isinstance(value, torch.Tensor):
            yield (name, key), value


def pin(buffer: torch.Tensor) -> None:
    """Page-lock `buffer`'s memory as it is (cudaHostRegister, as DCP's stager does): its
    copies from the GPU then run at full bandwidth, and it stays exactly its size, where
    `pin_memory=True` goes through torch's caching host allocator, which rounds an
    allocation up to a power of two and keeps it."""
    code = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.nbytes, 0))
    if code != 0:
        raise CheckpointError(
            f"checkpoint.async_save: pinning the {buffer.nbytes} bytes of host memory of a "
            f"background save failed (cudaHostRegister error {code}); lower the host memory "
            "the run holds, or set checkpoint.async_save = false"
        )


def _unpin(address: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(address)


def shared_buffer(nbytes: int) -> torch.Tensor:
    """`nbytes` of host memory in shared memory (/dev/shm on Linux), which the writer process
    maps too: reserved whole at once, so a full /dev/shm is an error here, not a SIGBUS at
    the copy."""
    try:
        storage = torch.UntypedStorage._new_shared(nbytes)  # as DCP's stager allocates
    except RuntimeError as e:
        raise CheckpointError(
            f"checkpoint.async_save: the host copy of this rank's state needs {nbytes} bytes "
            f"of shared memory for the background writer process: {e} (a container's "
            "/dev/shm is small unless --shm-size raises it); or set checkpoint.async_save = false"
        ) from e
    return torch.empty(0, dtype=torch.uint8).set_(storage)


class HostCopy:
    """Host copies of a rank's weights and optimizer state: one flat buffer of exactly their
    bytes (what the plan counts as `host_checkpoint_copy`) in shared memory, allocated once
    and kept for the next save (the previous write is over by then) while every tensor's
    key, shape and dtype stay the same.  Each tensor is a view of it at an offset that is a
    multiple of its element size, with no padding: the tensors of larger elements come first.
    Pinned on CUDA (`pin`).  The generators' states (a few KB) are copied apart."""

    def __init__(self):
        self.buffer: torch.Tensor | None = None  # uint8, every view's memory
        self.views: dict[tuple, torch.Tensor] = {}  # key -> its view of `buffer`
        self.unpin = None  # unregisters a pinned buffer, once: at `release` or with this copy
        self.copied = 0  # tensors copied by this save, for the "copying" fault
        self.iteration = 0

    def nbytes(self) -> int:
        return 0 if self.buffer is None else self.buffer.nbytes

    def allocate(self, tensors: list[tuple[tuple, torch.Tensor]]) -> None:
        """The buffer and its views for `tensors` (key, tensor), unless the kept ones fit."""
        fits = len(tensors) == len(self.views) and all(
            (v := self.views.get(key)) is not None and v.shape == t.shape and v.dtype == t.dtype
            for key, t in tensors
        )
        if fits:
            return
        self.release()
        order = sorted(tensors, key=lambda kt: -kt[1].element_size())  # stable: larger first
        total = sum(t.nbytes for _, t in order)
        self.buffer = shared_buffer(total)
        if any(t.device.type == "cuda" for _, t in order):
            pin(self.buffer)
            self.unpin = weakref.finalize(self, _unpin, self.buffer.data_ptr())
            self.unpin.atexit = False  # not after CUDA's own teardown (as DCP's stager)
        offset = 0
        for key, t in order:
            self.views[key] = view(self.buffer, offset, t.dtype, t.shape)
            offset += t.nbytes

    def release(self) -> None:
        """Unpin and drop the buffer (the next save allocates one)."""
        if self.unpin is not None:
            self.unpin()
        self.buffer, self.views, self.unpin = None, {}, None

    def tensor(self, key: tuple, t: torch.Tensor) -> torch.Tensor:
        buffer = self.views.get(key)
        if buffer is None:  # the generators' states
            return t.detach().to("cpu", copy=True)
        buffer.copy_(t.detach(), non_blocking=True)
        self.copied += 1
        return buffer

    def state(self, name: str, state: dict, path: Path) -> dict:
        """`state` (a DCP or torch.save state dict) with every tensor in host buffers; a TP
        shard (a DTensor over TP) as the one piece of its global tensor this rank holds."""
        out = {}
        for key, value in state.items():
            if self.copied == 1:
                fault("copying", self.iteration, path, dist.get_rank())
            if isinstance(value, Pieces):
                pieces = [
                    (list(o), self.tensor((name, key, tuple(o)), t))
                    for o, t in value._pieces.items()
                ]
                out[key] = Pieces(value.shape, value.dtype, torch.device("cpu"), pieces)
            elif isinstance(value, DTensor):
                local = value.to_local()
                (placement,) = value.placements  # Shard(dim) over TP: see dcp.global_tensor
                offsets = [0] * local.dim()
                offsets[placement.dim] = (
                    value.device_mesh.get_local_rank() * local.shape[placement.dim]
                )
                copy = self.tensor((name, key), local)
                out[key] = Pieces(value.shape, value.dtype, torch.device("cpu"), [(offsets, copy)])
            elif isinstance(value, torch.Tensor):
                out[key] = self.tensor((name, key), value)
            else:
                out[key] = value
        return out

    def snapshot(self, snap: saving.Snapshot, path: Path) -> saving.Snapshot:
        self.copied, self.iteration = 0, snap.iteration
        self.allocate([
            *_local_tensors("model", snap.model), *_local_tensors("optimizer", snap.optimizer)
        ])  # fmt: skip
        staged = saving.Snapshot(
            snap.iteration,
            self.state("model", snap.model, path),
            self.state("optimizer", snap.optimizer, path),
            self.state("rng", snap.rng, path),
            snap.meta,
            snap.tokenizer,
        )
        if torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()  # the non-blocking copies have landed
        return staged


# The states of an `AsyncSaver` (its `state`).
IDLE, WRITING, ABANDONED, CLOSED = "idle", "writing", "abandoned", "closed"


def writers_store() -> tuple[str, int, str]:
    """Where the writer processes meet: the job's own TCPStore (every rank reached it), under
    a key prefix of their own that rank 0 draws (every rank calls it: a broadcast)."""
    store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if not isinstance(store, dist.TCPStore):
        raise CheckpointError(
            "checkpoint.async_save: the background writers meet in the job's TCPStore (torchrun, "
            f"megatrain run, env://); this job's process group was made with a "
            f"{type(store).__name__}"
        )
    prefix = [f"megatrain/checkpoint-writers/{uuid.uuid4().hex}/" if dist.get_rank() == 0 else ""]
    dist.broadcast_object_list(prefix, src=0)
    return store.host, store.port, prefix[0]


def _stop(process, conn) -> None:
    """Ask the writer process to stop, then wait for it; also when its saver is collected or
    at exit, where a write still in flight (a run ended by an error) is cut short: a kill
    leaves nothing half published (`save.publish`), as the end of a process left its thread."""
    with contextlib.suppress(OSError):  # gone already
        conn.send(("stop",))
    process.join(10)
    if process.is_alive():
        process.kill()
        process.join()
    conn.close()


class AsyncSaver:
    """A rank's background saves, one small state machine: `save(run)` copies and returns;
    `wait()` collects the outcome; `checkpoint` is a save step of the training loop.

    States (`state`):

    - idle: no write in flight: none yet, or the last one collected (published, or raised);
    - writing: the writer process was handed the host copy of iteration `iteration`, its
      outcome not collected yet (the writer may be done already);
    - abandoned: every rank gave the write up at a deadline: its writer stops at its next
      agreement, writes nothing more and publishes nothing (`pending` stays true);
    - closed: the writer process stopped.

    Transitions:

    - `save(run)`, start: idle -> writing, finishing the write in flight first (`wait`);
    - `wait()`, finish: writing or abandoned -> idle, reading the writer's outcome; a failed
      write raises its `CheckpointError`, the same on every rank;
    - `written_by(deadline, device)`, the deadline check: the writer waited for until
      `deadline`, then whether every rank's is over (an all-reduce on the default group, so
      every rank gets the same answer); no state changes;
    - `abandon()`: writing -> abandoned (every rank must call it);
    - `collect(info, device, deadline, bound)`: writing -> idle (`wait`) or, past `deadline`
      (`written_by` false), -> abandoned; idle stays idle;
    - `checkpoint(run, last, bound, info)`: collect the write in flight, start this
      iteration's, and collect that one too when it is the run's `last` save, all within
      `bound` seconds (a stop by a signal; None: no deadline);
    - `close()`: -> closed: a write in flight collected first, an abandoned one's writer
      killed (it would only stop at its next agreement), the writer process stopped.

    Made by every rank at the same point (the writers' store prefix is a broadcast); the
    writer process starts then, and joins its peers while training goes on."""

    def __init__(self, ckpt: str | Path, keep: int, collective_timeout: float):
        self.ckpt, self.keep = Path(ckpt), keep
        self.host = HostCopy()
        self.state = IDLE
        self.iteration: int | None = None  # of the write in flight or last collected
        self.reply: tuple | None = None  # the writer's (iteration, error) for the write in flight
        self.writer_gpus: int | None = None  # the GPUs the writer sees (its "ready" message)
        self.gone: str | None = None  # how the writer process died, once it has
        self.copy_s = 0.0  # the last save's stall: the host copy and its hand-over
        self.sent = None  # the buffer the writer holds
        store = writers_store()
        ctx = mp.get_context("spawn")
        self.abandon_flag = ctx.RawValue(ctypes.c_byte, 0)  # read by the writer at agreements
        self.conn, child = ctx.Pipe()
        rank, world = dist.get_rank(), dist.get_world_size()
        writer = Writer(self.ckpt, keep, rank, world, self.abandon_flag, os.getpid())
        self.process = ctx.Process(
            target=serve, args=(child, writer, store, collective_timeout),
            name=f"megatrain-checkpoint-writer-{rank}", daemon=True,
        )  # fmt: skip
        self.process.start()
        child.close()  # so a writer that dies shows as the end of the pipe
        self._stop = weakref.finalize(self, _stop, self.process, self.conn)

    @property
    def pending(self) -> bool:
        return self.state in (WRITING, ABANDONED)

    def save(self, run) -> None:
        """Wait for the previous write, copy this rank's state, hand it to the writer (whose
        first save waits for it to have joined its peers)."""
        self.wait()
        started = time.perf_counter()
        self.ready()
        tmp = saving.tmp_dir(self.ckpt, run.iteration)
        staged = self.host.snapshot(saving.snapshot(run), tmp)
        buffer = self.host.buffer
        job = ("write", carried(staged, buffer), os.environ.get(FAULT_ENV))
        self.iteration, self.reply, self.state = run.iteration, None, WRITING
        self.abandon_flag.value = 0
        try:
            if self.sent is not buffer:  # the first save, or a new layout
                self.conn.send(("buffer", buffer))
                self.sent = buffer
            self.conn.send(job)
        except OSError:  # the writer is gone: said at `wait`
            self.gone = self.gone or self._died()
        self.copy_s = time.perf_counter() - started

    def ready(self) -> None:
        """Block until the writer process has joined its peers (or is gone)."""
        while self.writer_gpus is None and self.gone is None:
            self._read(None)

    def _read(self, timeout: float | None) -> bool:
        """Take the writer's next message, waiting up to `timeout` seconds (None: until it
        comes): False when none came; True also once the writer is gone (`gone` says how)."""
        if self.gone is None and self.conn.poll(timeout):
            try:
                message = self.conn.recv()
            except EOFError:
                self.gone = self._died()
            else:
                if message[0] == "ready":  # once, first
                    self.writer_gpus = message[2]
                else:
                    self.reply = message
            return True
        return self.gone is not None

    def over(self, timeout: float | None = 0.0) -> bool:
        """Whether the writer is done with the write in flight, waiting for it up to `timeout`
        seconds (None: until it is); its outcome is then in `reply`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.reply is None:
            if self.gone is not None:
                n = self.iteration
                self.reply = (n, f"{self.gone} while saving iteration {n}")
                break
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self._read(left):
                return False
        return True

    def _died(self) -> str:
        self.process.join(5)
        code = self.process.exitcode
        how = f"killed by {signal.Signals(-code).name}" if code and code < 0 else f"exit {code}"
        return (
            f"the background writer process of rank {dist.get_rank()} (pid {self.process.pid}) "
            f"died ({how})"
        )

    def wait(self) -> None:
        """Block until the write in flight is over (at once when none is).  A failed write
        raises its `CheckpointError`, the same on every rank."""
        if not self.pending:
            return
        self.over(None)
        error = self.reply[1]
        self.state = IDLE
        if error is not None:
            raise CheckpointError(f"{error}; {self.standing()}")

    def written_by(self, deadline: float, device) -> bool:
        """Wait for the writer until `deadline` (time.monotonic); whether every rank's is over.
        Every rank gives up, or none (training is over: the default group is idle)."""
        over = self.over(max(0.0, deadline - time.monotonic()))
        done = torch.tensor([float(over)], device=device)
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
        return bool(done.item())

    def collect(self, info, device, deadline: float | None, bound) -> bool:
        """Wait for the background write in flight (until `deadline`): True when it is published
        (or there was none), False when every rank gives it up.  A failed write raises.
        `info` says which (rank 0's log)."""
        if not self.pending:
            return True
        if deadline is not None and not self.written_by(deadline, device):
            self.abandon()
            info(
                f"megatrain: abandoned the background write of iteration {self.iteration} after "
                f"checkpoint.async_save_timeout = {bound:g} s; {self.standing()}"
            )
            return False
        self.wait()
        info(f"megatrain: saved {iteration_dir(self.ckpt, self.iteration)}")
        return True

    def checkpoint(self, run, last: bool, bound: float | None, info) -> None:
        """Save at this iteration, copied now and written in the background.  The last save of
        a run (`last`: the end, exit_interval, a stop) waits for its write and publishes it;
        under a signal (`bound`) for at most that many seconds in all, the previous write
        included, else every rank abandons the write (`latest` names what it named)."""
        deadline = None if bound is None else time.monotonic() + bound
        if not self.collect(info, run.device, deadline, bound):
            return
        self.save(run)
        info(
            f"megatrain: writing {iteration_dir(self.ckpt, run.iteration)} in the background "
            f"(copied to host memory in {self.copy_s:.3f} s)"
        )
        if last:
            self.collect(info, run.device, deadline, bound)

    def standing(self) -> str:
        """What `latest` names now, checked whole (every file, its size)."""
        try:
            directory = find_checkpoint(self.ckpt)
        except CheckpointError:
            return f"no complete checkpoint in {self.ckpt} yet"
        return (
            f"{self.ckpt / 'latest'} names {directory.name} (iteration "
            f"{read_meta(directory)['iteration']}), checked whole"
        )

    def abandon(self) -> None:
        """Have the writer stop at its next agreement (every rank must call it): nothing more
        is written and nothing published."""
        if self.state == WRITING:
            self.state = ABANDONED
            self.abandon_flag.value = 1

    def close(self) -> None:
        """Stop the writer process: a write in flight is collected first; an abandoned one's
        writer is killed (SIGKILL: nothing published is left half done, see `save.publish`)."""
        if self.state == CLOSED:
            return
        if self.state == WRITING:
            self.wait()
        if self.state == ABANDONED:
            self.process.kill()
        self._stop()
        self.state = CLOSED
