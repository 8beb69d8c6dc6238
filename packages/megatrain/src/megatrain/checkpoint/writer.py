"""The background save's writer: a process of its own per rank, outside the training process's
interpreter lock (`checkpoint.async_save`; `AsyncSaver` in background.py is the training
side).

Started once (spawn) when the run starts, it joins the other ranks' writers in a gloo group
of their own, made from the job's own store (the TCPStore every rank met in) under a key
prefix of its own: a process cannot join the training process's groups, and its own group
lets it run DCP's save whole (the planning, the metadata, this rank's files) as a
synchronous save does.  It then waits for jobs on a pipe: the host buffer (`buffer`: one
flat block of shared memory the training process copies into, sent once and again only when
its layout changes) and a save (`carried`: the snapshot with each tensor named by its offset in
that buffer), which it writes through the path of a synchronous save (`.tmp-iter_N/`, every
file checked, `publish`) and answers with its outcome.  It sees no GPU (it only reads host
memory), so it holds no CUDA context anywhere; it dies with its training process.
"""

import ctypes
import errno
import io
import os
import signal
import sys
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from megatrain.checkpoint import save as saving
from megatrain.checkpoint.dcp import Pieces, own_storage
from megatrain.checkpoint.files import iteration_dir

# A test's fault in the background save of one iteration: "<point>:<rank>:<action>:<iteration>",
# point one of copying (the training process's copy), writing (in the writer, between the
# weights and the optimizer state), publishing (in the writer, between the rename of the
# directory and `latest`); action kill (SIGKILL to the rank: its training process, and from
# the writer the writer too), writerkill (SIGKILL to the writer alone), enospc / erofs (the
# OSError a full disk or a read-only directory raises), or sleep<seconds>.
FAULT_ENV = "MEGATRAIN_TEST_SAVE_FAULT"


def fault(point: str, iteration: int, path: Path, rank: int, training_pid: int | None = None):
    """The test's fault at `point`, if it names this rank and iteration (`training_pid`: in the
    writer, the training process's pid)."""
    spec = os.environ.get(FAULT_ENV, "").split(":")
    if len(spec) != 4 or spec[0] != point:
        return
    _, at_rank, action, at = spec
    if int(at_rank) != rank or int(at) != iteration:
        return
    if action == "kill" and training_pid is not None:
        os.kill(training_pid, signal.SIGKILL)
    if action in ("kill", "writerkill"):
        os.kill(os.getpid(), signal.SIGKILL)
    elif action in ("enospc", "erofs"):
        code = errno.ENOSPC if action == "enospc" else errno.EROFS
        raise OSError(code, os.strerror(code), str(path))
    elif action.startswith("sleep"):
        time.sleep(float(action[5:]))


def view(buffer: torch.Tensor, offset: int, dtype: torch.dtype, shape) -> torch.Tensor:
    """A tensor of `dtype` and `shape` at byte `offset` of the flat uint8 `buffer`, whose
    storage is exactly its bytes (DCP writes a view's whole storage otherwise)."""
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    return own_storage(buffer[offset : offset + nbytes].view(dtype).view(shape))


@dataclass(frozen=True)
class Slot:
    """A tensor of the shared buffer, by its byte offset."""

    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Chunks:
    """A `Pieces` (a global tensor's pieces this rank holds), its tensors as `Slot`s."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: list[tuple[list[int], Slot]]


@dataclass(frozen=True)
class Inline:
    """A small tensor outside the buffer (a generator's state), carried as torch.save bytes."""

    data: bytes


def _encode_tensor(t: torch.Tensor, buffer: torch.Tensor):
    start = t.data_ptr() - buffer.data_ptr()
    if start >= 0 and start + t.nbytes <= buffer.nbytes and t.is_contiguous():
        return Slot(start, t.dtype, tuple(t.shape))
    data = io.BytesIO()
    torch.save(t, data)
    return Inline(data.getvalue())


def encode(state: dict, buffer: torch.Tensor) -> dict:
    """A staged state dict (its tensors views of `buffer`) as a job carries it."""
    out = {}
    for key, value in state.items():
        if isinstance(value, Pieces):
            pieces = [(list(o), _encode_tensor(t, buffer)) for o, t in value._pieces.items()]
            out[key] = Chunks(tuple(value.shape), value.dtype, pieces)
        elif isinstance(value, torch.Tensor):
            out[key] = _encode_tensor(value, buffer)
        else:
            out[key] = value
    return out


def _decode_tensor(value, buffer: torch.Tensor) -> torch.Tensor:
    if isinstance(value, Slot):
        return view(buffer, value.offset, value.dtype, value.shape)
    return torch.load(io.BytesIO(value.data), weights_only=True)


def decode(state: dict, buffer: torch.Tensor) -> dict:
    """`encode`'s state dict again, its tensors views of the writer's mapping of the buffer."""
    out = {}
    for key, value in state.items():
        if isinstance(value, Chunks):
            pieces = [(o, _decode_tensor(t, buffer)) for o, t in value.pieces]
            out[key] = Pieces(value.shape, value.dtype, torch.device("cpu"), pieces)
        elif isinstance(value, Slot | Inline):
            out[key] = _decode_tensor(value, buffer)
        else:
            out[key] = value
    return out


def carried(snap: saving.Snapshot, buffer: torch.Tensor, how=encode) -> saving.Snapshot:
    """`snap` with its state dicts `encode`d for a job (`how=decode`: back again)."""
    states = ("model", "optimizer", "rng")
    return replace(snap, **{name: how(getattr(snap, name), buffer) for name in states})


def _one_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else repr(e)


@dataclass
class Writer:
    """What a writer process knows: its rank and peers, where to save, and the flag the
    training process raises when every rank abandons the write in flight."""

    ckpt: Path
    keep: int
    rank: int
    world: int
    abandoned: object  # a shared ctypes byte: nonzero once the training process abandoned
    training_pid: int

    def _agree(self, error: str | None) -> str | None:
        """Every rank's outcome of a phase, shared: the first rank's error, else whether any
        rank's training process abandoned the write, else None."""
        outcomes = [None] * self.world
        dist.all_gather_object(outcomes, (error, bool(self.abandoned.value)))
        errors = [e for e, _ in outcomes if e is not None]
        if errors:
            return errors[0]
        return "abandoned" if any(a for _, a in outcomes) else None

    def _phase(self, n: int, fn, *args) -> str | None:
        try:
            fn(*args)
        except (OSError, dcp.api.CheckpointException) as e:
            return str(saving.save_failed(n, self.ckpt, e, " (in the background)"))
        except Exception as e:  # said on every rank, raised at `AsyncSaver.wait`
            return f"saving iteration {n} in the background failed: {e!r}"
        return None

    def write(self, staged: saving.Snapshot) -> str | None:
        """Each phase ends in an agreement, and the next one starts only when every rank's
        went well and no rank abandoned the write: None, or the error every rank reports."""
        n = staged.iteration
        tmp, final = saving.tmp_dir(self.ckpt, n), iteration_dir(self.ckpt, n)
        rank0 = self.rank == 0
        hook = lambda point, path: lambda: fault(point, n, path, self.rank, self.training_pid)  # noqa: E731
        phases = [
            (saving.prepare, tmp) if rank0 else None,
            (saving.write_model, staged, tmp, None, hook("writing", tmp)),
            (saving.write_optimizer, staged, tmp, None),
            (saving.complete, staged, self.ckpt, self.world, self.keep, hook("publishing", final))
            if rank0
            else None,
        ]
        try:
            for phase in phases:
                error = self._agree(self._phase(n, *phase) if phase else None)
                if error is not None:
                    return error
        except Exception as e:  # a peer's writer gone (or hung) in an agreement
            cause = _one_line(e).split("] ", 1)[-1].split(". ")[0]  # gloo's, without its source
            return (
                f"saving iteration {n} in the background failed: the agreement with the other "
                f"ranks' writer processes broke off ({cause}): one of them died or hangs"
            )
        return None


def _die_with(parent: int) -> None:
    """SIGKILL this process when its training process dies (Linux: the kernel sends it), as a
    thread of that process would die with it; elsewhere the pipe's end stops it when idle."""
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it died before the call above
        os._exit(1)


def serve(conn, writer: Writer, store: tuple[str, int, str], timeout: float) -> None:
    """The writer process: join the writers' group, then write each job the pipe brings until
    told to stop (or the training process is gone).  Messages it sends: ("ready", None or the
    error that kept it from joining, the GPUs it sees), then per job (iteration, error)."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # host memory only: no context on any GPU
    _die_with(writer.training_pid)
    torch.set_num_threads(1)  # it copies nothing: leave the cores to training
    os.nice(10)  # background work: where cores are short, the training's steps come first
    host, port, prefix = store
    joined = None
    try:
        wait = timedelta(seconds=timeout)
        tcp = dist.TCPStore(host, port, is_master=False, timeout=wait, wait_for_workers=False)
        dist.init_process_group(
            "gloo", store=dist.PrefixStore(prefix, tcp), rank=writer.rank,
            world_size=writer.world, timeout=wait,
        )  # fmt: skip
    except Exception as e:
        joined = f"the background writer of rank {writer.rank} could not join its peers: {e}"
    conn.send(("ready", joined, torch.cuda.device_count()))
    buffer = None
    try:
        while True:
            try:
                message = conn.recv()
            except EOFError:  # the training process is gone
                return
            if message[0] == "stop":
                return
            if message[0] == "buffer":
                buffer = message[1]
                continue
            _, job, spec = message  # the snapshot `carried`, the test's fault spec
            if spec is None:
                os.environ.pop(FAULT_ENV, None)
            else:
                os.environ[FAULT_ENV] = spec
            error = joined or writer.write(carried(job, buffer, decode))
            conn.send((job.iteration, error))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
