"""A collective that failed, said in one line: which rank, which operation, which peers.

A rank that hangs (a stuck kernel, a deadlocked data loader, a stopped process) leaves the
others waiting in their next collective.  After `parallel.collective_timeout` seconds the
backend gives up: NCCL's watchdog names the operation itself; gloo raises a bare "Timed out
waiting 600000ms for recv operation".  `explain` turns such an error into a message that
names this rank, the operation (the torch.distributed call, or the function that waited on
an asynchronous one), the group's ranks and the iteration, so the job ends with a line that
points at the rank to look at, and the launcher (`megatrain run`) reports it.
"""

import torch.distributed as dist

# What the backends say when a peer never came (timeouts) or went away (a dead peer).
TIMEOUT_WORDS = ("timed out", "timeout")
LOST_PEER_WORDS = ("connection closed", "connection reset", "broken pipe", "closed by peer")


class CollectiveFailure(RuntimeError):
    """A collective timed out, or a peer went away while this rank was in it."""


def _group_in(frame) -> object:
    """The one process group a frame of ours works on (a local, or an attribute of `self`)."""
    values = list(frame.f_locals.values())
    if "self" in frame.f_locals:
        values += list(getattr(frame.f_locals["self"], "__dict__", {}).values())
    groups = {id(v): v for v in values if isinstance(v, dist.ProcessGroup)}
    return next(iter(groups.values())) if len(groups) == 1 else None


def _innermost_call(exc: BaseException) -> tuple[str, object]:
    """(the operation, its group or None) from the traceback: the innermost torch.distributed
    function, else the innermost function of ours, which waited on an asynchronous one."""
    c10d, ours = None, None
    tb = exc.__traceback__
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if name.endswith("distributed_c10d.py") and c10d is None:
            c10d = tb
        elif "/megacore/" in name or "/megatrain/" in name:
            ours = tb
        tb = tb.tb_next
    where = ""
    if ours is not None:
        code = ours.tb_frame.f_code
        where = f"{code.co_name} ({code.co_filename.rsplit('/src/', 1)[-1]}:{ours.tb_lineno})"
    if c10d is not None:
        op = c10d.tb_frame.f_code.co_name
        return (f"{op}, called from {where}" if where else op), c10d.tb_frame.f_locals.get("group")
    if ours is not None:
        return f"an asynchronous collective awaited in {where}", _group_in(ours.tb_frame)
    return "a collective", None


def explain(exc: BaseException, timeout: float, iteration: int | None) -> str | None:
    """One line for a failed collective, or None when `exc` is not one."""
    text = str(exc).lower()
    timed_out = any(w in text for w in TIMEOUT_WORDS)
    lost = any(w in text for w in LOST_PEER_WORDS)
    if not (timed_out or lost) or not dist.is_initialized():
        return None
    rank = dist.get_rank()
    op, group = _innermost_call(exc)
    try:
        ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    except (RuntimeError, ValueError):
        ranks = None
    peers = [r for r in ranks if r != rank] if ranks else None
    peers_text = ", ".join(map(str, peers)) if peers else "its peers"
    at = f" at iteration {iteration}" if iteration is not None else ""
    if timed_out:
        return (
            f"rank {rank} waited {timeout:g} s in {op}{at}, and rank(s) {peers_text} "
            "never arrived: stuck or dead. Look at those ranks' output; if a step legitimately "
            "takes longer, raise parallel.collective_timeout"
        )
    return (
        f"rank {rank} lost a peer in {op}{at}: rank(s) {peers_text} went away "
        f"(killed or crashed): {str(exc).splitlines()[0][:200]}"
    )
