"""Pipeline schedules behind one entry point, `get_forward_backward_func(schedule)`.

Each schedule is a table per rank (`tables.py`: `schedule_no_pipelining`,
`schedule_1f1b`, `schedule_interleaved`, `schedule_zb_h1`) of compute steps,
`Step("F" | "B" | "W", microbatch, chunk)`, and communication steps, `Comm`,
each posted as one batch; one executor here follows them.  The tables place
every transfer so that the k-th batch a rank posts with a neighbour mirrors the
neighbour's k-th, which NCCL needs (it runs a send only when the peer's
matching receive runs, and batches to one peer in order); gloo buffers sends
and would hide a table that breaks this, so `megacore.testing.nccl_semantics`
holds the tests to NCCL's rule.  An output that has been sent is freed (its
storage replaced by one element, its autograd graph kept), so under 1F1B a rank
holds activations of at most pp - rank microbatches.

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
from megacore.pipeline_parallel.tables import (
    Comm,
    Step,
    compute_steps,
    schedule_1f1b,
    schedule_interleaved,
    schedule_no_pipelining,
    schedule_zb_h1,
)
from megacore.tensor_parallel.weight_grad import (
    apply_weight_grads,
    deferring_weight_grads,
    split_backward,
)

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
    split: bool = False  # backwards split into B (input gradient) and W (weight gradients)


def _execute(run: _Run, table: list, interleaved: bool) -> list:
    """Follow a schedule table: compute steps, and communication batches.

    A batch is posted whole and waited for only when a compute step needs what it
    brings (Megatron's overlap_p2p_comm): an interleaved rank starts its next forward
    while the gradient for its next backward is still arriving.  Batches complete in
    the order they were posted (one stream per communicator under NCCL), and a sent
    output is freed once its batch has completed.

    Split backwards (ZB-H1): forwards and B steps run under `split_backward()`, a B step
    keeps its linears' weight gradients (`deferring_weight_grads`) and its W step computes
    them.  Data-parallel hooks then see a weight's gradient at W and the other parameters'
    at B, so every B runs under no_sync and only the last microbatch's W steps sync; the
    parameters no W touches are reduced when the schedule finishes (finish_grad_sync).
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
    deferred: dict[tuple[int, int], list] = {}  # split: each B's weight gradients, for its W

    def sync_context(step: Step):
        last = last_backward.get(step.chunk) == step.microbatch
        if run.forward_only or (last and not (run.split and step.kind == "B")):
            return contextlib.nullcontext()
        return run.no_sync_func(run.chunks[step.chunk])

    def split_context():
        return split_backward() if run.split else contextlib.nullcontext()

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
                with grad_mode, sync_context(step), split_context():
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
            elif step.kind == "B":
                grad = None if last else wait_for(step)
                input_tensor, output = inputs.pop(key), outputs.pop(key)
                if last and run.grad_scale_func is not None:
                    output = run.grad_scale_func(output)
                if run.split:
                    with sync_context(step), split_backward(), deferring_weight_grads() as later:
                        custom_backward(output, grad)
                    deferred[key] = later
                else:
                    with sync_context(step):
                        custom_backward(output, grad)
                if not first:
                    input_grads[step] = input_tensor.grad
            else:  # W: the weight gradients its B deferred
                with sync_context(step):
                    apply_weight_grads(deferred.pop(key))
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
    elif kind == "zb-h1":
        if any(isinstance(c, nn.parallel.DistributedDataParallel) for c in chunks):
            raise ValueError(
                "pipeline schedule zb-h1: torch's DistributedDataParallel reduces gradients "
                "from autograd hooks that the deferred weight gradients (W) bypass; wrap the "
                "model in megacore.distributed.DistributedDataParallel"
            )
        table = schedule_zb_h1(num_microbatches, pp, rank, forward_only)
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
        split=kind == "zb-h1",
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


def forward_backward_zero_bubble(**kwargs) -> list:
    """ZB-H1: 1F1B with each backward split into B and W, the Ws filling the bubble."""
    return _forward_backward("zb-h1", **kwargs)


SCHEDULES = ("1f1b", "interleaved", "zb-h1")


def get_forward_backward_func(schedule: str | None = None) -> Callable[..., list]:
    """The schedule for the current layout, all called with the same keyword arguments.

    `schedule`: "1f1b", "interleaved" or "zb-h1"; None takes the layout's (interleaved
    when there are virtual stages, else 1F1B).  Without pipeline stages every schedule
    is plain gradient accumulation.
    """
    pp = ps.get_pipeline_model_parallel_world_size()
    vpp = ps.get_virtual_pipeline_model_parallel_world_size() or 1
    if schedule is not None and schedule not in SCHEDULES:
        raise ValueError(
            f"pipeline schedule: unknown schedule {schedule!r}; expected one of {SCHEDULES}"
        )
    if schedule is None:
        schedule = "interleaved" if vpp > 1 else "1f1b"
    if (schedule == "interleaved") != (vpp > 1):
        raise ValueError(
            f"pipeline schedule {schedule!r} with a virtual pipeline size of {vpp}: the "
            "interleaved schedule is the one for virtual stages (size > 1), and only it"
        )
    if pp == 1:
        return forward_backward_no_pipelining
    return {
        "1f1b": forward_backward_pipelining_without_interleaving,
        "interleaved": forward_backward_pipelining_with_interleaving,
        "zb-h1": forward_backward_zero_bubble,
    }[schedule]
