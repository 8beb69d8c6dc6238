"""Pipeline schedules behind one entry point, `get_forward_backward_func()`.

Each schedule is a table per rank, made by a plain function
(`schedule_no_pipelining`, `schedule_1f1b`, `schedule_interleaved`) and run by
one executor.  A table holds compute steps, `Step("F" | "B", microbatch,
chunk)`, and communication steps, `Comm`: one batch of sends and receives
posted together, naming the step whose tensor each moves.  The tables can be
printed and tested on their own; the executor only follows them.

The batches are Megatron's (warm-up forwards, steady one-forward-one-backward,
cool-down backwards, with `send_forward_recv_backward` and
`send_backward_recv_forward` fused in the steady state), so that the k-th
batch a rank posts with a neighbour is the mirror image of the neighbour's
k-th batch with it.  That is what NCCL needs: it runs a send only when the
peer's matching receive runs, batches to one peer run in order, and two ranks
that each send first and receive afterwards wait on each other forever.  Gloo
buffers sends and would hide such a schedule; `megacore.testing.nccl_semantics`
holds the tests to NCCL's rule.  An output that has been sent is freed (its
storage replaced by one element, its autograd graph kept), so under 1F1B a
rank holds activations of at most pp - rank microbatches.

`forward_step_func(data_iterator, model) -> (output, loss_func)` and
`loss_func(output) -> (loss, info_dict)` follow Megatron-LM; the loss is divided
by the number of microbatches, so the gradients are those of the mean loss.
"""

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.autograd import Variable

from megacore import parallel_state as ps
from megacore.pipeline_parallel.p2p_communication import communicate


@dataclass(frozen=True)
class Step:
    """Compute: the forward ("F") or backward ("B") of one microbatch on one model chunk."""

    kind: str  # "F" forward or "B" backward
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


@dataclass(frozen=True)
class _Batch:
    """A `Comm` before its receives are bound: which directions receive, not yet what."""

    send_next: Step | None = None
    send_prev: Step | None = None
    recv_prev: bool = False
    recv_next: bool = False


def compute_steps(table: list) -> list[Step]:
    """The forwards and backwards of a table, in order, without its communication."""
    return [item for item in table if isinstance(item, Step)]


class _Stages:
    """Which steps of this rank talk to a neighbour: the first stage has no input to
    receive nor gradient to send, the last no output to send nor gradient to receive."""

    def __init__(self, pipeline_size: int, pipeline_rank: int, num_chunks: int = 1):
        self.first_rank, self.last_rank = pipeline_rank == 0, pipeline_rank == pipeline_size - 1
        self.last_chunk = num_chunks - 1

    def is_first(self, step: Step) -> bool:
        return self.first_rank and step.chunk == 0

    def is_last(self, step: Step) -> bool:
        return self.last_rank and step.chunk == self.last_chunk

    def send(self, step: Step) -> _Batch:
        """The batch that sends what `step` produced (empty when it goes nowhere)."""
        if step.kind == "F":
            return _Batch(send_next=None if self.is_last(step) else step)
        return _Batch(send_prev=None if self.is_first(step) else step)


def _bind(items: list, forwards: list[Step], backwards: list[Step], stages: _Stages) -> list:
    """Name what each receive brings.

    A neighbour sends its tensors in the order of its own steps, which is the
    order of ours (every rank runs microbatches and chunks in the same order),
    so the n-th activation received is the input of our n-th forward that needs
    one, and likewise for gradients.  Empty batches are dropped.
    """
    inputs = iter([s for s in forwards if not stages.is_first(s)])
    grads = iter([s for s in backwards if not stages.is_last(s)])
    table = []
    for item in items:
        if isinstance(item, Step):
            table.append(item)
            continue
        comm = Comm(
            send_next=item.send_next,
            recv_prev=next(inputs) if item.recv_prev else None,
            send_prev=item.send_prev,
            recv_next=next(grads) if item.recv_next else None,
        )
        if comm != Comm():
            table.append(comm)
    return table


def schedule_no_pipelining(num_microbatches: int, forward_only: bool = False) -> list[Step]:
    """Forward and backward of each microbatch in turn (gradient accumulation)."""
    steps = []
    for m in range(num_microbatches):
        steps.append(Step("F", m))
        if not forward_only:
            steps.append(Step("B", m))
    return steps


def schedule_1f1b(
    num_microbatches: int, pipeline_size: int, pipeline_rank: int, forward_only: bool = False
) -> list:
    """Warm-up of pp - rank - 1 forwards, then one forward one backward, then cool-down.

    Communication is Megatron's: in the steady state a forward's output goes out
    in one batch with the receive of the next backward's gradient, and a
    backward's input gradient in one batch with the receive of the next forward's
    input, so each batch meets the neighbour's mirror image (NCCL needs that).
    """
    stages = _Stages(pipeline_size, pipeline_rank)
    takes_input, takes_grad = not stages.first_rank, not stages.last_rank
    forwards = [Step("F", m) for m in range(num_microbatches)]
    backwards = [Step("B", m) for m in range(num_microbatches)]
    items: list = []
    if forward_only:
        for f in forwards:
            items += [_Batch(recv_prev=takes_input), f, stages.send(f)]
        return _bind(items, forwards, backwards, stages)
    warmup = min(pipeline_size - pipeline_rank - 1, num_microbatches)
    remaining = num_microbatches - warmup
    for f in forwards[:warmup]:
        items += [_Batch(recv_prev=takes_input), f, stages.send(f)]
    if remaining:
        items.append(_Batch(recv_prev=takes_input))
    for i in range(remaining):
        f, b = forwards[warmup + i], backwards[i]
        items += [f, _Batch(send_next=stages.send(f).send_next, recv_next=takes_grad), b]
        last = i == remaining - 1
        items.append(_Batch(send_prev=stages.send(b).send_prev, recv_prev=takes_input and not last))
    for b in backwards[remaining:]:
        items += [_Batch(recv_next=takes_grad), b, stages.send(b)]
    return _bind(items, forwards, backwards, stages)


def check_interleaved_microbatches(num_microbatches: int, pipeline_size: int) -> None:
    if num_microbatches % pipeline_size:
        raise ValueError(
            f"the interleaved schedule needs num_microbatches ({num_microbatches}) to be a "
            f"multiple of pipeline_model_parallel_size ({pipeline_size}); use "
            f"{(num_microbatches // pipeline_size + 1) * pipeline_size} or no virtual stages"
        )


def _interleaved_step(kind: str, k: int, pp: int, vpp: int) -> Step:
    """The k-th forward or backward: microbatch (k // (pp vpp)) pp + k % pp on chunk
    (k // pp) % vpp, the chunks in reverse for backwards."""
    chunk = (k // pp) % vpp
    microbatch = (k // (pp * vpp)) * pp + k % pp
    return Step(kind, microbatch, chunk if kind == "F" else vpp - 1 - chunk)


def schedule_interleaved(
    num_microbatches: int,
    pipeline_size: int,
    pipeline_rank: int,
    num_chunks: int,
    forward_only: bool = False,
) -> list:
    """Interleaved 1F1B over `num_chunks` model chunks per rank (Megatron's order).

    Warm-up is 2 (pp - rank - 1) + (vpp - 1) pp forwards, or all of them when
    num_microbatches == pp.  In the steady state a forward and a backward run,
    then one batch sends both results and receives both next inputs.  When a
    receive is needed follows Megatron: the first rank runs pp - 1 steps ahead of
    the last, so whether the last rank's output comes round to it now is read
    off the step pp - 1 back (and the same for gradients on the last rank).
    """
    check_interleaved_microbatches(num_microbatches, pipeline_size)
    pp, vpp, rank = pipeline_size, num_chunks, pipeline_rank
    stages = _Stages(pp, rank, vpp)
    total = num_microbatches * vpp

    def F(k):
        return _interleaved_step("F", k, pp, vpp)

    def B(k):
        return _interleaved_step("B", k, pp, vpp)

    forwards, backwards = [F(k) for k in range(total)], [B(k) for k in range(total)]
    all_warmup = forward_only or num_microbatches == pp
    warmup = total if all_warmup else min((pp - rank - 1) * 2 + (vpp - 1) * pp, total)
    remaining = total - warmup

    items: list = [_Batch(recv_prev=not stages.first_rank)]
    for k in range(warmup):
        items.append(F(k))
        recv_prev = not (stages.first_rank and F(k + 1).chunk == 0) and k < total - 1
        recv_next = k == warmup - 1 and not all_warmup and not stages.last_rank
        items.append(_Batch(stages.send(F(k)).send_next, None, recv_prev, recv_next))
    for k in range(remaining):
        items += [F(warmup + k), B(k)]
        recv_prev = k < remaining - 1 and not (
            stages.first_rank and F(warmup + k - (pp - 1)).chunk == vpp - 1
        )
        recv_next = not (stages.last_rank and B(k - (pp - 1)).chunk == 0)
        send_next, send_prev = stages.send(F(warmup + k)).send_next, stages.send(B(k)).send_prev
        items.append(_Batch(send_next, send_prev, recv_prev, recv_next))
    if not forward_only:
        if all_warmup:
            items.append(_Batch(recv_next=not stages.last_rank))
        for k in range(remaining, total):
            items.append(B(k))
            recv_next = not (stages.last_rank and B(k + 1).chunk == vpp - 1) and k < total - 1
            items.append(_Batch(send_prev=stages.send(B(k)).send_prev, recv_next=recv_next))
    return _bind(items, forwards, backwards if not forward_only else [], stages)


_current: list = [None]  # the table item running now, for error messages


def current_step() -> str | None:
    """The schedule item this rank is at (`F3.1`, `[>next F3 <next B0]`), or None."""
    return None if _current[0] is None else repr(_current[0])


def deallocate_output_tensor(out: torch.Tensor) -> None:
    """Free an output's storage once sent; its grad_fn stays for the backward step."""
    out.data = torch.empty((1,), device=out.device, dtype=out.dtype)


def custom_backward(output: torch.Tensor, grad_output: torch.Tensor | None) -> None:
    """Backward from an output whose storage was freed (torch.autograd.backward checks shapes)."""
    if grad_output is None:  # the loss on the last stage
        grad_output = torch.ones_like(output, memory_format=torch.preserve_format)
    Variable._execution_engine.run_backward(
        tensors=(output,),
        grad_tensors=(grad_output,),
        keep_graph=False,
        create_graph=False,
        inputs=(),
        allow_unreachable=True,
        accumulate_grad=True,
    )


def _default_no_sync(model: nn.Module):
    no_sync = getattr(model, "no_sync", None)
    return no_sync() if no_sync is not None else contextlib.nullcontext()


@dataclass
class _Run:
    forward_step_func: Callable
    data_iterators: list
    chunks: list[nn.Module]
    num_microbatches: int
    tensor_shape: tuple[int, ...]
    dtype: torch.dtype
    forward_only: bool
    variable_seq_lengths: bool
    no_sync_func: Callable
    grad_scale_func: Callable | None
    collect_non_loss_data: bool = False


def _execute(run: _Run, table: list, interleaved: bool) -> list:
    """Follow a schedule table: compute steps, and communication batches.

    A batch is posted whole and waited for only when a compute step needs what it
    brings (Megatron's overlap_p2p_comm): an interleaved rank starts its next forward
    while the gradient for its next backward is still arriving.  Batches complete in
    the order they were posted (one stream per communicator under NCCL), and a sent
    output is freed once its batch has completed.
    """
    steps = compute_steps(table)
    received: dict[Step, torch.Tensor] = {}  # activations (F steps) and gradients (B steps)
    inputs: dict[tuple[int, int], torch.Tensor | None] = {}
    outputs: dict[tuple[int, int], torch.Tensor] = {}
    input_grads: dict[Step, torch.Tensor | None] = {}
    # (requests, steps whose tensors it brings, tensors it sends, output to free when done)
    in_flight: list[tuple[list, tuple, tuple, torch.Tensor | None]] = []
    # Gradients sync over data parallel only in the chunk's last microbatch: every other
    # forward and backward runs under no_sync (torch's DDP decides in forward).
    last_backward = {s.chunk: s.microbatch for s in steps if s.kind == "B"}

    def sync_context(step: Step):
        if run.forward_only or last_backward.get(step.chunk) == step.microbatch:
            return contextlib.nullcontext()
        return run.no_sync_func(run.chunks[step.chunk])

    losses = []
    comm = {"tensor_shape": run.tensor_shape, "dtype": run.dtype}
    comm["variable_seq_lengths"] = run.variable_seq_lengths

    def complete(count: int) -> None:
        """Wait for the `count` oldest batches in flight."""
        for requests, _, _, to_free in in_flight[:count]:
            for request in requests:
                request.wait()
            if to_free is not None:  # sent: only its autograd graph is still needed
                deallocate_output_tensor(to_free)
        del in_flight[:count]

    def wait_for(step: Step) -> torch.Tensor:
        """What a batch in flight brings for `step`, once that batch (and older ones) are done."""
        for i, (_, brings, _, _) in enumerate(in_flight):
            if step in brings:
                complete(i + 1)
                break
        return received.pop(step)

    def exchange(batch: Comm) -> None:
        send_next = None if batch.send_next is None else outputs[_key(batch.send_next)]
        send_prev = None if batch.send_prev is None else input_grads.pop(batch.send_prev)
        from_prev, from_next, requests = communicate(
            tensor_send_next=send_next,
            tensor_send_prev=send_prev,
            recv_prev=batch.recv_prev is not None,
            recv_next=batch.recv_next is not None,
            wait=False,
            **comm,
        )
        if batch.recv_prev is not None:
            received[batch.recv_prev] = from_prev
        if batch.recv_next is not None:
            received[batch.recv_next] = from_next
        if batch.send_next is not None and run.forward_only:
            outputs.pop(_key(batch.send_next))  # nothing runs backward through it
        brings = tuple(s for s in (batch.recv_prev, batch.recv_next) if s is not None)
        to_free = send_next if not run.forward_only else None
        in_flight.append((requests, brings, (send_next, send_prev), to_free))
        # Free what finished sending already, so outputs do not pile up between waits.
        done = 0
        while done < len(in_flight) and all(r.is_completed() for r in in_flight[done][0]):
            done += 1
        complete(done)

    try:
        for item in table:
            _current[0] = item
            if isinstance(item, Comm):
                exchange(item)
                continue
            step, key = item, _key(item)
            chunk = run.chunks[step.chunk]
            if interleaved:
                ps.set_virtual_pipeline_model_parallel_rank(step.chunk)
            first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
            if step.kind == "F":
                input_tensor = None if first else wait_for(step)
                set_input = _wrapped_attr(chunk, "set_input_tensor")
                if set_input is not None:
                    set_input(input_tensor)
                elif not first:
                    raise TypeError(
                        f"pipeline schedule: {type(chunk).__name__} needs a "
                        "set_input_tensor(tensor) method to take the previous stage's activation"
                    )
                grad_mode = torch.no_grad() if run.forward_only else contextlib.nullcontext()
                with grad_mode, sync_context(step):
                    output, loss_func = run.forward_step_func(run.data_iterators[step.chunk], chunk)
                    if last and run.collect_non_loss_data:
                        losses.append(loss_func(output, non_loss_data=True))
                    elif last:
                        loss, info = loss_func(output)
                        losses.append(info)
                        output = loss / run.num_microbatches
                if not last or not run.forward_only:
                    outputs[key] = output
                if not run.forward_only:
                    inputs[key] = input_tensor
            else:
                grad = None if last else wait_for(step)
                input_tensor, output = inputs.pop(key), outputs.pop(key)
                if last and run.grad_scale_func is not None:
                    output = run.grad_scale_func(output)
                with sync_context(step):
                    custom_backward(output, grad)
                if not first:
                    input_grads[step] = input_tensor.grad
        complete(len(in_flight))
    finally:
        _current[0] = None
        if interleaved:
            ps.set_virtual_pipeline_model_parallel_rank(0)
    return losses


def _key(step: Step) -> tuple[int, int]:
    """Forward and backward of one microbatch on one chunk share their tensors."""
    return step.microbatch, step.chunk


def _wrapped_attr(module: nn.Module, name: str):
    """`module.name`, looking through wrappers that keep the model in `.module` (DDP)."""
    while not hasattr(module, name) and hasattr(module, "module"):
        module = module.module
    return getattr(module, name, None)


def _as_list(x, n: int, what: str) -> list:
    items = list(x) if isinstance(x, (list, tuple)) else [x]
    if len(items) != n:
        raise ValueError(
            f"pipeline schedule: expected {n} {what} (one per model chunk), got {len(items)}"
        )
    return items


def _forward_backward(
    kind: str,
    *,
    forward_step_func: Callable,
    data_iterator: Iterator | list[Iterator],
    model: nn.Module | list[nn.Module],
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    hidden_size: int | None = None,
    dtype: torch.dtype = torch.float32,
    sequence_parallel: bool = False,
    variable_seq_lengths: bool = False,
    forward_only: bool = False,
    no_sync_func: Callable | None = None,
    grad_scale_func: Callable | None = None,
    finalize_model_grads_func: Callable | None = None,
    collect_non_loss_data: bool = False,
    decoder_seq_length: int | None = None,
    first_val_step: bool | None = None,  # accepted for Megatron callers; nothing to tune here
) -> list:
    if decoder_seq_length is not None:
        raise ValueError(
            "pipeline schedule: encoder-decoder models (decoder_seq_length) are not supported"
        )
    if collect_non_loss_data and not forward_only:
        raise ValueError("pipeline schedule: collect_non_loss_data=True needs forward_only=True")
    if num_microbatches < 1:
        raise ValueError(
            f"pipeline schedule: num_microbatches must be >= 1, got {num_microbatches}"
        )
    pp, rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    vpp = ps.get_virtual_pipeline_model_parallel_world_size() or 1
    n_chunks = vpp if kind == "interleaved" else 1
    chunks = _as_list(model, n_chunks, "models")
    iterators = _as_list(data_iterator, n_chunks, "data iterators")
    if kind == "none":
        table = schedule_no_pipelining(num_microbatches, forward_only)
    elif kind == "1f1b":
        table = schedule_1f1b(num_microbatches, pp, rank, forward_only)
    else:
        table = schedule_interleaved(num_microbatches, pp, rank, vpp, forward_only)
    if hidden_size is None:  # a Megatron-style model carries it in its config
        hidden_size = getattr(getattr(chunks[0], "config", None), "hidden_size", None)
    if pp > 1 and hidden_size is None and not variable_seq_lengths:
        raise ValueError(
            "pipeline schedule: pass hidden_size (or a model with config.hidden_size) "
            "for the shape of the activations sent between stages"
        )
    seq = seq_length
    if sequence_parallel:
        seq //= ps.get_tensor_model_parallel_world_size()
    run = _Run(
        forward_step_func=forward_step_func,
        data_iterators=iterators,
        chunks=chunks,
        num_microbatches=num_microbatches,
        tensor_shape=(seq, micro_batch_size, hidden_size),
        dtype=dtype,
        forward_only=forward_only,
        variable_seq_lengths=variable_seq_lengths,
        no_sync_func=no_sync_func or _default_no_sync,
        grad_scale_func=grad_scale_func,
        collect_non_loss_data=collect_non_loss_data,
    )
    losses = _execute(run, table, interleaved=kind == "interleaved")
    if finalize_model_grads_func is not None and not forward_only:
        finalize_model_grads_func(chunks)
    return losses


def forward_backward_no_pipelining(**kwargs) -> list:
    """All microbatches on one stage; gradients sync over data parallel only after the last."""
    return _forward_backward("none", **kwargs)


def forward_backward_pipelining_without_interleaving(**kwargs) -> list:
    """1F1B over the pipeline stages."""
    return _forward_backward("1f1b", **kwargs)


def forward_backward_pipelining_with_interleaving(**kwargs) -> list:
    """Interleaved 1F1B: `model` and `data_iterator` are lists, one per virtual chunk."""
    return _forward_backward("interleaved", **kwargs)


def get_forward_backward_func() -> Callable[..., list]:
    """The schedule for the current layout, all called with the same keyword arguments."""
    if ps.get_pipeline_model_parallel_world_size() == 1:
        return forward_backward_no_pipelining
    if (ps.get_virtual_pipeline_model_parallel_world_size() or 1) > 1:
        return forward_backward_pipelining_with_interleaving
    return forward_backward_pipelining_without_interleaving
