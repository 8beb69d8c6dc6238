"""Pipeline schedules as tables: what each rank computes, and when it talks to its neighbours.

A table is a list per rank of compute steps, `Step("F" | "B" | "W", microbatch,
chunk)`, and communication steps, `Comm`: one batch of sends and receives
posted together, naming the step whose tensor each moves.  A schedule is made
in two parts:

1. **The order of compute steps** on every rank, a plain function per schedule
   (`order_1f1b`, `order_interleaved`, `order_zb_h1`).
2. **Where the communication goes**, the same for every schedule
   (`bind_communication`): the orders are played on a clock (`timeline`, a
   forward costs 1, a backward 2, or 1 + 1 when split into B and W), which
   orders every transfer by the time its tensor is sent.  Each send is posted
   right after the step that produced its tensor, and each receive right after
   this rank's previous transfer in that order, as early as the order allows.
   So a forward's output leaves as soon as it exists, and a neighbour's next
   input is already being received while this rank computes: Megatron-LM's
   overlap_p2p_comm, for every schedule.

NCCL runs a batch only when each peer runs a batch holding the matching
operations, and the batches between two ranks in the order they were posted.
Each transfer is a batch of its own, so the forward-direction and
backward-direction exchanges are never fused and each batch is matched by
exactly one batch of its peer.  Both ranks of a pair post their transfers in
the order of one key (the time the clock sent the tensor, then activations
before gradients, then the sender), so the k-th batch a rank posts with a
neighbour always mirrors the neighbour's k-th.  Every rank posts its transfers
in the order of their keys, and a tensor's key is later than those of every
tensor it was made from, so no rank ever waits on a batch its peer can only
post later: even a rank that blocks at every batch until its peer posts the
match (stricter than NCCL, whose transfers on one communicator also run in the
order posted) finishes.  (Two transfers to different peers in one batch would
break this: the batch would wait for both, and a cycle of such batches around
the pipeline can hang.)
`megacore.testing.nccl_semantics` holds real runs to that rule.

**ZB-H1** (Qi et al., 2023, "Zero Bubble Pipeline Parallelism") splits each
backward into B, the input gradient the previous stage waits for, and W, the
weight gradient nobody waits for.  Rank r runs 1F1B's pp - r forwards, then
B, W, F per microbatch, except that its first r weight gradients are deferred
to the end, where they fill the time 1F1B spends waiting for gradients.  With
F = B = W its bubble is (pp - 1) / (3 m), a third of 1F1B's, and no rank holds
more than pp microbatches between F and W, 1F1B's peak (rank 0's).
"""

import bisect
import functools
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Step:
    """Compute on one microbatch and model chunk: its forward ("F"), its backward ("B", the
    input and weight gradients; under ZB-H1 only the input gradient), or its weight
    gradient ("W", ZB-H1's deferred half of the backward)."""

    kind: str
    microbatch: int
    chunk: int = 0

    def __repr__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


@dataclass(frozen=True)
class Comm:
    """One batch of sends and receives posted together (one NCCL group).

    Each field names the compute step whose tensor moves: `send_next` the forward
    whose output goes on, `recv_prev` the forward whose input arrives,
    `send_prev` the backward whose input gradient goes back, `recv_next` the
    backward whose output gradient arrives.
    """

    send_next: Step | None = None
    recv_prev: Step | None = None
    send_prev: Step | None = None
    recv_next: Step | None = None

    def __repr__(self) -> str:
        parts = [
            f"{label} {step!r}"
            for label, step in (
                (">next", self.send_next),
                ("<prev", self.recv_prev),
                (">prev", self.send_prev),
                ("<next", self.recv_next),
            )
            if step is not None
        ]
        return "[" + " ".join(parts) + "]"


# Relative costs for placing the communication (and for the bubble's theory): a backward
# is twice a forward; split, its two halves cost a forward each.
COSTS = {"F": 1, "B": 2, "W": 0}
SPLIT_COSTS = {"F": 1, "B": 1, "W": 1}


def compute_steps(table: list) -> list[Step]:
    """The forwards and backwards of a table, in order, without its communication."""
    return [item for item in table if isinstance(item, Step)]


def check_interleaved_microbatches(num_microbatches: int, pipeline_size: int) -> None:
    if num_microbatches % pipeline_size:
        raise ValueError(
            f"the interleaved schedule needs num_microbatches ({num_microbatches}) to be a "
            f"multiple of pipeline_model_parallel_size ({pipeline_size}); use "
            f"{(num_microbatches // pipeline_size + 1) * pipeline_size} or no virtual stages"
        )


# -- the orders of compute steps ------------------------------------------------------------


def order_no_pipelining(num_microbatches: int, forward_only: bool = False) -> list[Step]:
    """Forward and backward of each microbatch in turn (gradient accumulation)."""
    steps = []
    for m in range(num_microbatches):
        steps.append(Step("F", m))
        if not forward_only:
            steps.append(Step("B", m))
    return steps


def order_1f1b(
    num_microbatches: int, pipeline_size: int, pipeline_rank: int, forward_only: bool = False
) -> list[Step]:
    """Warm-up of pp - rank - 1 forwards, then one forward one backward, then cool-down:
    rank r holds the activations of at most pp - r microbatches."""
    forwards = [Step("F", m) for m in range(num_microbatches)]
    if forward_only:
        return forwards
    backwards = [Step("B", m) for m in range(num_microbatches)]
    warmup = min(pipeline_size - pipeline_rank - 1, num_microbatches)
    order = forwards[:warmup]
    for f, b in zip(forwards[warmup:], backwards, strict=False):
        order += [f, b]
    return order + backwards[num_microbatches - warmup :]


def _interleaved_step(kind: str, k: int, pp: int, vpp: int) -> Step:
    """The k-th forward or backward: microbatch (k // (pp vpp)) pp + k % pp on chunk
    (k // pp) % vpp, the chunks in reverse for backwards."""
    chunk = (k // pp) % vpp
    microbatch = (k // (pp * vpp)) * pp + k % pp
    return Step(kind, microbatch, chunk if kind == "F" else vpp - 1 - chunk)


def order_interleaved(
    num_microbatches: int,
    pipeline_size: int,
    pipeline_rank: int,
    num_chunks: int,
    forward_only: bool = False,
) -> list[Step]:
    """Interleaved 1F1B over `num_chunks` model chunks per rank (Megatron-LM's order).

    Warm-up is 2 (pp - rank - 1) + (vpp - 1) pp forwards, or all of them when
    num_microbatches == pp; then a forward and a backward in turn; then cool-down.
    """
    check_interleaved_microbatches(num_microbatches, pipeline_size)
    pp, vpp = pipeline_size, num_chunks
    total = num_microbatches * vpp
    forwards = [_interleaved_step("F", k, pp, vpp) for k in range(total)]
    if forward_only:
        return forwards
    backwards = [_interleaved_step("B", k, pp, vpp) for k in range(total)]
    if num_microbatches == pp:
        warmup = total
    else:
        warmup = min((pp - pipeline_rank - 1) * 2 + (vpp - 1) * pp, total)
    order = forwards[:warmup]
    for f, b in zip(forwards[warmup:], backwards, strict=False):
        order += [f, b]
    return order + backwards[total - warmup :]


def order_zb_h1(
    num_microbatches: int, pipeline_size: int, pipeline_rank: int, forward_only: bool = False
) -> list[Step]:
    """ZB-H1: 1F1B's pp - rank forwards before the first backward, then per microbatch its
    input gradient B, a weight gradient W, and the next forward; rank r defers its first r
    weight gradients to the end (module doc)."""
    m, r = num_microbatches, pipeline_rank
    forwards = [Step("F", i) for i in range(m)]
    if forward_only:
        return forwards
    first = min(pipeline_size - r, m)
    order, deferred, next_forward = forwards[:first], 0, first
    for i in range(m):
        order.append(Step("B", i))
        if i >= r:
            order.append(Step("W", deferred))
            deferred += 1
        if next_forward < m:
            order.append(forwards[next_forward])
            next_forward += 1
    return order + [Step("W", i) for i in range(deferred, m)]


# -- playing the orders on a clock ----------------------------------------------------------


def producer(step: Step, rank: int, pp: int, vpp: int) -> tuple[int, Step] | None:
    """The (rank, step) on another stage whose output `step` needs, or None (the first
    stage's forwards, the last stage's backwards, weight gradients)."""
    m, c = step.microbatch, step.chunk
    if step.kind == "F":
        if rank > 0:
            return rank - 1, Step("F", m, c)
        return (pp - 1, Step("F", m, c - 1)) if c > 0 else None
    if step.kind == "B":
        if rank < pp - 1:
            return rank + 1, Step("B", m, c)
        return (0, Step("B", m, c + 1)) if c < vpp - 1 else None
    return None


def consumer(step: Step, rank: int, pp: int, vpp: int) -> tuple[int, Step] | None:
    """The (rank, step) on another stage that takes `step`'s output, or None."""
    m, c = step.microbatch, step.chunk
    if step.kind == "F":
        if rank < pp - 1:
            return rank + 1, Step("F", m, c)
        return (0, Step("F", m, c + 1)) if c < vpp - 1 else None
    if step.kind == "B":
        if rank > 0:
            return rank - 1, Step("B", m, c)
        return (pp - 1, Step("B", m, c - 1)) if c > 0 else None
    return None


def timeline(
    orders: list[list[Step]],
    num_chunks: int = 1,
    costs: dict[str, float] | Callable[[int, Step], float] = COSTS,
) -> dict[tuple[int, Step], tuple[float, float]]:
    """(start, end) of every step of every rank, each rank running its order one step at a
    time and starting a step once the step it needs on another stage has ended
    (communication free).  `costs`: per kind, or a function of (rank, step)."""
    pp = len(orders)
    cost = costs if callable(costs) else (lambda rank, step: costs[step.kind])
    times: dict[tuple[int, Step], tuple[float, float]] = {}
    clock, position = [0.0] * pp, [0] * pp
    progress = True
    while progress:
        progress = False
        for r in range(pp):
            while position[r] < len(orders[r]):
                step = orders[r][position[r]]
                needed = producer(step, r, pp, num_chunks)
                if needed is not None and needed not in times:
                    break
                start = max(clock[r], times[needed][1] if needed is not None else 0.0)
                clock[r] = start + cost(r, step)
                times[(r, step)] = (start, clock[r])
                position[r] += 1
                progress = True
    stuck = {r: orders[r][position[r]] for r in range(pp) if position[r] < len(orders[r])}
    if stuck:
        raise ValueError(f"pipeline schedule: the orders wait on each other at {stuck}")
    return times


def bubble(orders: list[list[Step]], num_chunks: int = 1, costs=COSTS) -> float:
    """The schedule's bubble on the clock: (makespan - busiest rank's compute) / that compute."""
    times = timeline(orders, num_chunks, costs)
    makespan = max(end for _, end in times.values())
    busy = max(
        sum(end - start for (r, _), (start, end) in times.items() if r == rank)
        for rank in range(len(orders))
    )
    return (makespan - busy) / busy


# -- communication --------------------------------------------------------------------------


def bind_communication(
    orders: list[list[Step]], rank: int, num_chunks: int = 1, costs=COSTS
) -> list:
    """Rank `rank`'s table: its order with the batches that move its tensors (module doc)."""
    pp = len(orders)
    times = timeline(orders, num_chunks, costs)
    ends = [times[(rank, s)][1] for s in orders[rank]]
    # (key, field, step): the key orders a message the same way on both ranks of a pair.
    ops = []
    for r, order in enumerate(orders):
        for step in order:
            to = consumer(step, r, pp, num_chunks)
            if to is None or rank not in (r, to[0]):
                continue
            key = (times[(r, step)][1], step.kind != "F", r, step.microbatch, step.chunk)
            if r == rank:
                ops.append((key, "send_next" if step.kind == "F" else "send_prev", step))
            if to[0] == rank:
                ops.append((key, "recv_prev" if step.kind == "F" else "recv_next", to[1]))
    ops.sort(key=lambda op: op[0])
    # A send goes right after the step that made its tensor; a receive as early as the order
    # allows, right after this rank's previous transfer.
    at: dict[int, list] = {}
    position = 0
    for key, field, step in ops:
        if field.startswith("send"):
            position = bisect.bisect_right(ends, key[0])  # the ends rise: a rank runs in order
        at.setdefault(position, []).append((field, step))
    table: list = []
    for position in range(len(ends) + 1):
        if position:
            table.append(orders[rank][position - 1])
        table += [Comm(**{field: step}) for field, step in at.get(position, [])]
    return table


# -- the schedules --------------------------------------------------------------------------


def schedule_no_pipelining(num_microbatches: int, forward_only: bool = False) -> list[Step]:
    """Forward and backward of each microbatch in turn (gradient accumulation)."""
    return order_no_pipelining(num_microbatches, forward_only)


def schedule_1f1b(
    num_microbatches: int, pipeline_size: int, pipeline_rank: int, forward_only: bool = False
) -> list:
    """1F1B (`order_1f1b`) with each transfer posted as early as it can be."""
    return list(_table("1f1b", num_microbatches, pipeline_size, pipeline_rank, 1, forward_only))


def schedule_interleaved(
    num_microbatches: int,
    pipeline_size: int,
    pipeline_rank: int,
    num_chunks: int,
    forward_only: bool = False,
) -> list:
    """Interleaved 1F1B (`order_interleaved`) with each transfer posted as early as it can be:
    a chunk's output leaves before the backward that follows it."""
    return list(
        _table(
            "interleaved", num_microbatches, pipeline_size, pipeline_rank, num_chunks, forward_only
        )
    )


def schedule_zb_h1(
    num_microbatches: int, pipeline_size: int, pipeline_rank: int, forward_only: bool = False
) -> list:
    """ZB-H1 (`order_zb_h1`): backwards split into B and W, weight gradients deferred into
    1F1B's bubble.  Forward-only it is 1F1B's forward-only table."""
    return list(_table("zb-h1", num_microbatches, pipeline_size, pipeline_rank, 1, forward_only))


@functools.lru_cache(maxsize=64)
def _table(
    schedule: str, microbatches: int, pp: int, rank: int, vpp: int, forward_only: bool
) -> tuple:
    """A rank's table, made once per shape: placing the transfers plays every rank's order."""
    if schedule == "interleaved":
        orders = [order_interleaved(microbatches, pp, r, vpp, forward_only) for r in range(pp)]
        return tuple(bind_communication(orders, rank, vpp))
    if schedule == "zb-h1":
        orders = [order_zb_h1(microbatches, pp, r, forward_only) for r in range(pp)]
        return tuple(bind_communication(orders, rank, costs=SPLIT_COSTS))
    orders = [order_1f1b(microbatches, pp, r, forward_only) for r in range(pp)]
    return tuple(bind_communication(orders, rank))
