"""Checkpoints written in the background (`checkpoint.async_save = true`).

At a save step each rank copies its share of the state (`save.snapshot`: the weights, the
optimizer's shards as they are, the generators, the data position; nothing gathered) into
one host buffer of its own (`HostCopy`: exactly its bytes, pinned on CUDA, kept from one save
to the next), and training goes
on while a thread of the same process writes that copy through the path a synchronous save
takes: `.tmp-iter_N/`, every file checked, `publish` (meta.json, the rename, `latest`).

A thread, not a process: a thread writes the host copy as it is, where a process
(Megatron-LM's persistent worker, DCP's PROCESS type) needs it handed over in shared memory.
The write is mostly file I/O, which leaves the GIL, and training steps spend their time in
torch operations, which leave it too; benchmarks/bench_async_checkpoint.py measures the steps
beside a write and the writer's share of the GIL (docs/checkpoints.md has the numbers).

The writers agree among themselves over a gloo group of their own (`AsyncSaver.group`, made
once on the main thread): the training collectives run on other groups at the same time, and
one group's collectives must never interleave between two threads.  Each phase ends in an
all-gather of every rank's outcome (an empty tmp directory; every rank's files written; rank
0's `publish`), so every rank learns the same outcome at the same phase, and `latest` moves
only after every rank's files are complete.  The main thread collects the outcome at the next
save (which first waits for the previous one), at a stop and at the end of training, points
every rank reaches at the same iteration: a failed write raises the same `CheckpointError`
on every rank there.  `AsyncSaver` is that side of it, one state machine (idle, writing,
abandoned, closed) whose transitions the training loop calls.
"""

import errno
import os
import signal
import threading
import time
import weakref
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from megatrain.checkpoint import save as saving
from megatrain.checkpoint.dcp import Pieces, own_storage
from megatrain.checkpoint.files import CheckpointError, find_checkpoint, iteration_dir, read_meta

# A test's fault in the background save of one iteration: "<point>:<rank>:<action>:<iteration>",
# point one of copying (the main thread's copy), writing (between the weights and the
# optimizer state), publishing (between the rename of the directory and `latest`); action kill
# (SIGKILL), enospc / erofs (the OSError a full disk or a read-only directory raises), or
# sleep<seconds>.
FAULT_ENV = "MEGATRAIN_TEST_SAVE_FAULT"


def fault(point: str, iteration: int, path: Path) -> None:
    spec = os.environ.get(FAULT_ENV, "").split(":")
    if len(spec) != 4 or spec[0] != point:
        return
    _, rank, action, at = spec
    if int(rank) != dist.get_rank() or int(at) != iteration:
        return
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action in ("enospc", "erofs"):
        code = errno.ENOSPC if action == "enospc" else errno.EROFS
        raise OSError(code, os.strerror(code), str(path))
    elif action.startswith("sleep"):
        time.sleep(float(action[5:]))


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


class HostCopy:
    """Host copies of a rank's weights and optimizer state: one flat buffer of exactly their
    bytes (what the plan counts as `host_checkpoint_copy`), allocated once and kept for the
    next save (the previous write is over by then) while every tensor's key, shape and dtype
    stay the same.  Each tensor is a view of it at an offset that is a multiple of its element
    size, with no padding: the tensors of larger elements come first.  Pinned on CUDA (`pin`).
    The generators' states (a few KB, fresh tensors already) are copied as they are."""

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
        self.buffer = torch.empty(total, dtype=torch.uint8)
        if any(t.device.type == "cuda" for _, t in order):
            pin(self.buffer)
            self.unpin = weakref.finalize(self, _unpin, self.buffer.data_ptr())
            self.unpin.atexit = False  # not after CUDA's own teardown (as DCP's stager)
        offset = 0
        for key, t in order:
            view = self.buffer[offset : offset + t.nbytes].view(t.dtype).view(t.shape)
            self.views[key] = own_storage(view)  # DCP writes its bytes, not the whole buffer's
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
                fault("copying", self.iteration, path)
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


def use_device(device: torch.device) -> None:
    """The writer thread's CUDA device: the rank's.  A new thread starts on CUDA's default
    device 0, and DCP's file writer synchronises the current stream, so each rank's first
    background save would make a context on GPU 0 and wait on GPU 0's stream (torch's own
    pin-memory thread sets its device the same way)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


# The states of an `AsyncSaver` (its `state`).
IDLE, WRITING, ABANDONED, CLOSED = "idle", "writing", "abandoned", "closed"


class AsyncSaver:
    """A rank's background saves, one small state machine: `save(run)` copies and returns;
    `wait()` collects the outcome; `checkpoint` is a save step of the training loop.

    States (`state`):

    - idle: no write in flight: none yet, or the last one collected (published, or raised);
    - writing: a writer thread started on the host copy of iteration `iteration`, its
      outcome not collected yet (the thread may be over already);
    - abandoned: every rank gave the write up at a deadline: its writer stops at its next
      agreement, writes nothing more and publishes nothing; its thread and its group are
      kept (`pending` stays true: the writer may be in an agreement on the group still);
    - closed: the writers' group destroyed.

    Transitions:

    - `save(run)`, start: idle -> writing, finishing the write in flight first (`wait`);
    - `wait()`, finish: writing or abandoned -> idle, joining the writer; a failed write
      raises its `CheckpointError`, the same on every rank;
    - `written_by(deadline, device)`, the deadline check: the writer waited for until
      `deadline`, then whether every rank's is over (an all-reduce on the default group, so
      every rank gets the same answer); no state changes;
    - `abandon()`: writing -> abandoned (every rank must call it);
    - `collect(info, device, deadline, bound)`: writing -> idle (`wait`) or, past `deadline`
      (`written_by` false), -> abandoned; idle stays idle;
    - `checkpoint(run, last, bound, info)`: collect the write in flight, start this
      iteration's, and collect that one too when it is the run's `last` save, all within
      `bound` seconds (a stop by a signal; None: no deadline);
    - `close()`: idle -> closed; a pending write (an abandoned one) keeps its group and its
      state.

    Made by every rank at the same point (its gloo group is a collective to create)."""

    def __init__(self, ckpt: str | Path, keep: int, collective_timeout: float):
        self.ckpt, self.keep = Path(ckpt), keep
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=collective_timeout))
        self.host = HostCopy()
        self.state = IDLE
        self.thread: threading.Thread | None = None
        self.iteration: int | None = None  # of the write in flight or last collected
        self.error: str | None = None
        self.copy_s = 0.0  # the last save's stall: the host copy

    @property
    def pending(self) -> bool:
        return self.state in (WRITING, ABANDONED)

    @property
    def abandoned(self) -> bool:
        """Read by the writer at each agreement."""
        return self.state == ABANDONED

    def save(self, run) -> None:
        """Wait for the previous write, copy this rank's state, start writing it."""
        self.wait()
        started = time.perf_counter()
        tmp = saving.tmp_dir(self.ckpt, run.iteration)
        staged = self.host.snapshot(saving.snapshot(run), tmp)
        self.copy_s = time.perf_counter() - started
        self.iteration, self.error, self.state = run.iteration, None, WRITING
        self.thread = threading.Thread(
            target=self._write, args=(staged, run.device), name="megatrain-checkpoint", daemon=True
        )
        self.thread.start()

    def wait(self) -> None:
        """Block until the write in flight is over (at once when none is).  A failed write
        raises its `CheckpointError`, the same on every rank."""
        if self.thread is None:
            return
        self.thread.join()
        self.thread, self.state = None, IDLE
        if self.error is not None:
            raise CheckpointError(f"{self.error}; {self.standing()}")

    def written_by(self, deadline: float, device) -> bool:
        """Wait for the writer until `deadline` (time.monotonic); whether every rank's is over.
        Every rank gives up, or none (training is over: the default group is idle; the
        writers' group may still be busy)."""
        self.thread.join(max(0.0, deadline - time.monotonic()))
        done = torch.tensor([float(not self.thread.is_alive())], device=device)
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

    def _agree(self, error: str | None) -> str | None:
        """Every rank's outcome of a phase, shared: the first rank's error, else whether any
        rank's main thread abandoned the write (`abandon`), else None."""
        outcomes = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(outcomes, (error, self.abandoned), group=self.group)
        errors = [e for e, _ in outcomes if e is not None]
        if errors:
            return errors[0]
        return "abandoned" if any(a for _, a in outcomes) else None

    def _phase(self, fn, *args) -> str | None:
        try:
            fn(*args)
        except (OSError, dcp.api.CheckpointException) as e:
            return str(saving.save_failed(self.iteration, self.ckpt, e, " (in the background)"))
        except Exception as e:  # said on every rank, raised at `wait`
            return f"saving iteration {self.iteration} in the background failed: {e!r}"
        return None

    def _write(self, staged: saving.Snapshot, device: torch.device) -> None:
        """The writer thread: each phase ends in an agreement, and the next one starts only
        when every rank's went well and no rank abandoned the write."""
        use_device(device)
        n = staged.iteration
        tmp, final = saving.tmp_dir(self.ckpt, n), iteration_dir(self.ckpt, n)
        rank0 = dist.get_rank() == 0
        world = dist.get_world_size()
        publishing = lambda: fault("publishing", n, final)  # noqa: E731
        phases = [
            (saving.prepare, tmp) if rank0 else None,
            (saving.write_model, staged, tmp, self.group, lambda: fault("writing", n, tmp)),
            (saving.write_optimizer, staged, tmp, self.group),
            (saving.complete, staged, self.ckpt, world, self.keep, publishing) if rank0 else None,
        ]
        error = None
        try:
            for phase in phases:
                error = self._agree(self._phase(*phase) if phase else None)
                if error is not None:
                    break
        except Exception as e:  # a peer gone in an agreement
            error = f"saving iteration {n} in the background failed: {e}"
        self.error = error

    def abandon(self) -> None:
        """Have the writer stop at its next agreement (every rank must call it): nothing more
        is written and nothing published."""
        if self.state == WRITING:
            self.state = ABANDONED

    def close(self) -> None:
        """Destroy the writers' group, unless a write is pending: an abandoned write keeps
        its group."""
        if self.pending:
            return
        dist.destroy_process_group(self.group)
        self.state = CLOSED
