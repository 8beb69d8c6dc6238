"""NCCL's rules, enforced on gloo: a test double stricter than the backend it stands for.

Gloo forgives two things NCCL does not, so a schedule or a model that passes
on gloo can hang or crash on GPUs:

- **Unmatched sends.**  Gloo buffers a send until someone receives it.  NCCL
  runs a batch of sends and receives (one `batch_isend_irecv`, a NCCL group)
  only when each peer runs a batch holding the matching operations, and the
  batches between two ranks run in the order they were posted (one stream per
  communicator).  So two ranks that both send first and receive afterwards
  wait on each other forever.
- **Wrong tensors.**  Gloo takes CPU tensors and non-contiguous views; NCCL
  needs contiguous tensors on the rank's GPU.

Inside `nccl_semantics()`, every `batch_isend_irecv` is checked against the
peers' batches before it runs: the k-th batch rank r posts with peer q must
hold, in order, a receive for each send of q's k-th batch with r and a send
for each of its receives, of the same shape, dtype and tag (NCCL ignores tags,
so a swapped pair would deliver an activation as a gradient).  A mismatch
fails at once on both ranks, naming the two ranks, both batches and the
pipeline schedule step each was at; a peer that never posts its batch (a
deadlock) fails after `timeout` seconds with what that peer is waiting on.
This is stricter than NCCL in two ways, on purpose: a batch must be matched by
exactly one batch of the peer, where NCCL might let one group's operations
drain across two of the peer's; and a rank posting a batch waits until every
peer has posted its match, where NCCL returns at once and only orders the
transfers on the communicator's stream.  So the overlapped schedules, which
post forward-direction and backward-direction batches separately and ahead of
the compute that needs them, pass only if their batches meet in the same order
on both sides of every pair whichever direction they carry, and no rank's
early receive waits on a send its peer can post only later.  Every tensor
handed to a p2p operation or a collective must be on `device` (the rank's
training device) and contiguous.

`all_to_all_single` with uneven splits is checked across the group before it runs:
each rank's split sizes must add up to its tensors' first dimension, and what rank r
sends to q (its input_split_sizes[q]) must be what q expects from r (its
output_split_sizes[r]), in rows of the same size and dtype.  Gloo fails or
hangs on a mismatch with no word of which ranks disagreed; NCCL may copy the
wrong bytes without any error.  Without splits the first dimension must divide by
the group's size on every rank.

The batches are compared through the job's TCP store, so the check costs a
few store round trips per batch and nothing per collective but a look at the
arguments.  Code that torch.compile traces calls its own traceable collectives, which
the checker does not see.
"""

import contextlib
import functools
import inspect
import json
import sys
from collections.abc import Callable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

_COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
)
# Modules whose own names for torch.distributed functions are patched too
# (`from torch.distributed import all_reduce`, `all_gather_flat = dist.all_gather_into_tensor`).
_PATCHED_PACKAGES = ("torch.distributed", "megacore", "megatrain", "megaeval")

_contexts_entered = 0  # every rank enters contexts in the same order: a shared key prefix


class NCCLSemanticsError(RuntimeError):
    """A p2p batch or collective that NCCL would hang on or refuse."""


def _schedule_step() -> str:
    """Where the pipeline schedule is, for messages ("" outside a schedule)."""
    schedules = sys.modules.get("megacore.pipeline_parallel.schedules")
    step = schedules.current_step() if schedules is not None else None
    return f"schedule step {step}" if step else "outside a pipeline schedule"


def _describe(tensor: torch.Tensor) -> str:
    return f"{tuple(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}"


class _Checker:
    def __init__(self, store, device: torch.device, timeout: float, where: Callable[[], str]):
        self.store, self.device, self.timeout, self.where = store, device, timeout, where
        self.rank = dist.get_rank()
        self.batches: dict[tuple[str, int], int] = {}  # (group, peer) -> batches posted
        self.all_to_alls: dict[str, int] = {}  # group -> all_to_all_single calls

    def check_all_to_all(self, output, input, output_split_sizes, input_split_sizes, group):
        """Publish this rank's splits, read every rank's, and refuse (on every rank alike)
        unless each rank's splits fit its tensors and every pair agrees (module doc)."""
        group = group or dist.group.WORLD
        ranks = dist.get_process_group_ranks(group)
        world = len(ranks)
        mine = {"where": self.where(), "problem": None}
        for kind, t, sizes in (
            ("output", output, output_split_sizes),
            ("input", input, input_split_sizes),
        ):
            rows = t.shape[0] if t.dim() else 1
            if sizes is None:
                sizes = [rows // world] * world
                if rows % world:
                    mine["problem"] = (
                        f"its {kind} has {rows} rows, not divisible by the "
                        f"group's {world} ranks (no {kind}_split_sizes)"
                    )
            elif len(sizes) != world or sum(sizes) != rows:
                mine["problem"] = (
                    f"its {kind}_split_sizes {list(sizes)} are not {world} "
                    f"sizes adding up to the {kind}'s {rows} rows"
                )
            mine[kind] = {"splits": list(sizes), "row": list(t.shape[1:]), "dtype": str(t.dtype)}
        gkey = "-".join(map(str, ranks))
        index = self.all_to_alls.get(gkey, 0)
        self.all_to_alls[gkey] = index + 1
        what = f"all_to_all_single #{index} on group {ranks}"
        self.store.set(f"a2a/{gkey}/{index}/{self.rank}", json.dumps(mine))
        keys = [f"a2a/{gkey}/{index}/{r}" for r in ranks]
        try:
            self.store.wait(keys, timedelta(seconds=self.timeout))
        except Exception:  # the store's timeout error type differs between torch versions
            self._refuse(
                f"{what}: not every rank called it within {self.timeout:g} s "
                "(under NCCL this hangs)"
            )
        calls = {r: json.loads(self.store.get(key)) for r, key in zip(ranks, keys, strict=True)}
        for r, call in calls.items():
            if call["problem"]:
                self._refuse(f"{what}: rank {r} at {call['where']}: {call['problem']}")
        for a, sender in calls.items():
            for b, receiver in calls.items():
                send, recv = sender["input"], receiver["output"]
                sent = (send["splits"][ranks.index(b)], send["row"], send["dtype"])
                expected = (recv["splits"][ranks.index(a)], recv["row"], recv["dtype"])
                if sent != expected:
                    self._refuse(
                        f"{what}: rank {a} sends rank {b} {sent[0]} rows of {sent[1]} "
                        f"{sent[2]} (at {sender['where']}), rank {b} expects {expected[0]} "
                        f"rows of {expected[1]} {expected[2]} (at {receiver['where']}); "
                        "NCCL would move the wrong bytes or hang"
                    )

    def _refuse(self, why: str) -> None:
        raise NCCLSemanticsError(f"rank {self.rank}: {why} ({self.where()})")

    def check_tensor(self, tensor: torch.Tensor, what: str) -> None:
        if not isinstance(tensor, torch.Tensor):
            return
        if tensor.device != self.device:
            raise NCCLSemanticsError(
                f"rank {self.rank}: {what} got a tensor {_describe(tensor)} on {tensor.device}, "
                f"but this rank runs on {self.device}; NCCL takes only tensors on the rank's "
                f"device ({self.where()})"
            )
        if not tensor.is_contiguous():
            raise NCCLSemanticsError(
                f"rank {self.rank}: {what} got a non-contiguous tensor {_describe(tensor)} "
                f"(strides {tensor.stride()}); NCCL needs contiguous tensors ({self.where()})"
            )

    def check_batch(self, ops: list) -> None:
        """Publish this batch and wait for each peer's matching one; raise if they differ."""
        # Batches are ordered per communicator: the group's ranks name it.
        gkey = "-".join(map(str, dist.get_process_group_ranks(ops[0].group)))
        peers: dict[int, list[dict]] = {}
        for op in ops:
            self.check_tensor(op.tensor, "batch_isend_irecv")
            send = op.op is dist.isend
            peers.setdefault(op.peer, []).append(
                {"op": "send" if send else "recv", "tag": op.tag, "tensor": _describe(op.tensor)}
            )
        where = self.where()
        mine = {}
        for peer, peer_ops in peers.items():
            index = self.batches.get((gkey, peer), 0)
            self.batches[(gkey, peer)] = index + 1
            mine[peer] = (index, {"ops": peer_ops, "where": where})
            self.store.set(f"{gkey}/{self.rank}->{peer}/{index}", json.dumps(mine[peer][1]))
        pending = {str(p): ops for p, (_, ops) in mine.items()}
        self.store.set(f"pending/{self.rank}", json.dumps(pending))
        for peer, (index, batch) in mine.items():
            theirs = self._await(gkey, peer, index, batch)
            self._match(peer, index, batch, theirs)

    def _await(self, gkey: str, peer: int, index: int, batch: dict) -> dict:
        key, mine = f"{gkey}/{peer}->{self.rank}/{index}", f"{gkey}/{self.rank}->{peer}/{index}"
        try:
            self.store.wait([key], timedelta(seconds=self.timeout))
        except Exception:  # the store's timeout error type differs between torch versions
            # Withdraw our batch so that a peer arriving late fails too instead of posting a
            # receive no one answers.  If it is already gone, the peer took it (after
            # publishing its own, which it writes first): the match was just late.
            if self.store.delete_key(mine):
                posted = self.store.check([f"pending/{peer}"])
                stuck = self.store.get(f"pending/{peer}") if posted else b""
                raise NCCLSemanticsError(
                    f"rank {self.rank} waited {self.timeout:g} s for rank {peer}'s batch "
                    f"#{index} matching its own {_ops(batch)} at {batch['where']}: under NCCL "
                    f"this hangs. Rank {peer}'s last batch: {_pending(stuck)}"
                ) from None
        theirs = json.loads(self.store.get(key))
        self.store.delete_key(key)  # each key is read by its one peer
        return theirs

    def _match(self, peer: int, index: int, mine: dict, theirs: dict) -> None:
        flip = {"send": "recv", "recv": "send"}
        for direction in ("send", "recv"):
            a = [o for o in mine["ops"] if o["op"] == direction]
            b = [o for o in theirs["ops"] if o["op"] == flip[direction]]
            same = len(a) == len(b) and all(
                x["tag"] == y["tag"] and x["tensor"] == y["tensor"]
                for x, y in zip(a, b, strict=True)
            )
            if not same:
                low, high = sorted((self.rank, peer))
                first, second = (mine, theirs) if low == self.rank else (theirs, mine)
                raise NCCLSemanticsError(
                    f"batch #{index} between ranks {low} and {high} does not match, so under "
                    f"NCCL neither completes: rank {low} posted {_ops(first)} at "
                    f"{first['where']}; rank {high} posted {_ops(second)} at {second['where']}. "
                    "Each send needs the peer's receive of the same shape, dtype and tag in "
                    "its batch of the same index (post a send and the receive that answers "
                    "it together, as send_forward_recv_backward does)"
                )


def _ops(batch: dict) -> str:
    return "[" + ", ".join(f"{o['op']} tag {o['tag']} {o['tensor']}" for o in batch["ops"]) + "]"


def _pending(raw: bytes) -> str:
    if not raw:
        return "none posted"
    return "; ".join(
        f"with rank {peer}: {_ops(batch)} at {batch['where']}"
        for peer, batch in json.loads(raw).items()
    )


def _default_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _patch_everywhere(originals: dict[str, Callable], wrappers: dict[str, Callable]) -> list:
    """Replace each original function wherever our packages hold a name for it."""
    by_id = {id(f): wrappers[name] for name, f in originals.items()}
    undo = []
    for module_name, module in list(sys.modules.items()):
        if module is None or not module_name.startswith(_PATCHED_PACKAGES):
            continue
        for attr, value in list(vars(module).items()):
            wrapper = by_id.get(id(value))
            if wrapper is not None and callable(value):
                undo.append((module, attr, value))
                setattr(module, attr, wrapper)
    return undo


@contextlib.contextmanager
def nccl_semantics(
    device: torch.device | str | None = None,
    timeout: float = 30.0,
    where: Callable[[], str] = _schedule_step,
) -> Iterator[None]:
    """Within the block, p2p batches and collectives are held to NCCL's rules (module doc).

    `device`: the rank's training device (default: its CUDA device under NCCL,
    else the CPU).  `timeout`: seconds to wait for a peer's batch before calling
    it a deadlock.  Needs an initialized default process group; every rank of
    the job must enter the block.
    """
    global _contexts_entered
    _contexts_entered += 1
    store = dist.PrefixStore(
        f"nccl_semantics/{_contexts_entered}/", dist.distributed_c10d._get_default_store()
    )
    checker = _Checker(store, torch.device(device) if device else _default_device(), timeout, where)
    original_batch = dist.batch_isend_irecv

    def batch_isend_irecv(p2p_op_list):
        if p2p_op_list:
            checker.check_batch(p2p_op_list)
        return original_batch(p2p_op_list)

    def collective(name: str, fn: Callable) -> Callable:
        # The original's signature (functools.wraps): torch.compile, finding the patched
        # name where it looks for torch.distributed's collectives, reads it ("op").
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def checked(*args, **kwargs):
            for value in (*args, *kwargs.values()):
                tensors = value if isinstance(value, (list, tuple)) else [value]
                for t in tensors:
                    checker.check_tensor(t, name)
            if name == "all_to_all_single":
                bound = signature.bind(*args, **kwargs)
                bound.apply_defaults()
                a = bound.arguments
                checker.check_all_to_all(
                    a["output"],
                    a["input"],
                    a["output_split_sizes"],
                    a["input_split_sizes"],
                    a["group"],
                )
            return fn(*args, **kwargs)

        return checked

    originals = {"batch_isend_irecv": original_batch}
    originals |= {n: getattr(dist, n) for n in _COLLECTIVES if hasattr(dist, n)}
    wrappers = {"batch_isend_irecv": batch_isend_irecv}
    wrappers |= {n: collective(n, f) for n, f in originals.items() if n != "batch_isend_irecv"}
    undo = _patch_everywhere(originals, wrappers)
    try:
        yield
    finally:
        for module, attr, value in reversed(undo):
            setattr(module, attr, value)
