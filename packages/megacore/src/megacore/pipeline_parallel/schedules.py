"""Pipeline schedules behind one entry point, `get_forward_backward_func()` (seed 003).

Each schedule is a table of steps per rank, `Step("F" | "B", microbatch, chunk)`,
made by a plain function (`schedule_no_pipelining`, `schedule_1f1b`,
`schedule_interleaved`) and run by one executor.  The tables can be printed
and tested on their own; the executor only follows them:

- a forward step receives its input from the previous stage (blocking), runs
  `forward_step_func`, and sends the output on without waiting;
- a backward step receives the output's gradient from the next stage
  (blocking), runs backward, and sends the input's gradient back.

Because only receives block and every rank's table is ordered consistently with
its neighbours', no pipeline size can deadlock.  An output that has been sent is
freed (its storage replaced by one element, its autograd graph kept), so under
1F1B a rank holds activations of at most pp - rank microbatches.

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
    kind: str  # "F" forward or "B" backward
    microbatch: int
    chunk: int = 0

    def __repr__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


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
) -> list[Step]:
    """Warm-up of pp - rank - 1 forwards, then one forward one backward, then cool-down."""
    if forward_only:
        return [Step("F", m) for m in range(num_microbatches)]
    warmup = min(pipeline_size - pipeline_rank - 1, num_microbatches)
    steps = [Step("F", m) for m in range(warmup)]
    for i in range(num_microbatches - warmup):
        steps += [Step("F", warmup + i), Step("B", i)]
    steps += [Step("B", m) for m in range(num_microbatches - warmup, num_microbatches)]
    return steps


def check_interleaved_microbatches(num_microbatches: int, pipeline_size: int) -> None:
    if num_microbatches % pipeline_size:
        raise ValueError(
            f"the interleaved schedule needs num_microbatches ({num_microbatches}) to be a "
            f"multiple of pipeline_model_parallel_size ({pipeline_size}); use "
            f"{(num_microbatches // pipeline_size + 1) * pipeline_size} or no virtual stages"
        )


def schedule_interleaved(
    num_microbatches: int,
    pipeline_size: int,
    pipeline_rank: int,
    num_chunks: int,
    forward_only: bool = False,
) -> list[Step]:
    """Interleaved 1F1B over `num_chunks` model chunks per rank (Megatron's order).

    The k-th forward runs microbatch (k // (pp vpp)) pp + k % pp on chunk
    (k // pp) % vpp; backwards go through the chunks in reverse.  Warm-up is
    2 (pp - rank - 1) + (vpp - 1) pp forwards, or all of them when
    num_microbatches == pp.
    """
    check_interleaved_microbatches(num_microbatches, pipeline_size)
    pp, vpp = pipeline_size, num_chunks
    total = num_microbatches * vpp

    def step(kind, k):
        chunk = (k // pp) % vpp
        microbatch = (k // (pp * vpp)) * pp + k % pp
        return Step(kind, microbatch, chunk if kind == "F" else vpp - 1 - chunk)

    if forward_only:
        return [step("F", k) for k in range(total)]
    if num_microbatches == pp:
        warmup = total
    else:
        warmup = min((pp - pipeline_rank - 1) * 2 + (vpp - 1) * pp, total)
    steps = [step("F", k) for k in range(warmup)]
    for k in range(total - warmup):
        steps += [step("F", warmup + k), step("B", k)]
    steps += [step("B", k) for k in range(total - warmup, total)]
    return steps


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


def _execute(run: _Run, steps: list[Step], interleaved: bool) -> list:
    """Run a schedule table: blocking receives, sends that complete in the background."""
    inputs = [{} for _ in run.chunks]
    outputs = [{} for _ in run.chunks]
    # Gradients sync over data parallel only in the chunk's last microbatch: every other
    # forward and backward runs under no_sync (torch's DDP decides in forward).
    last_backward = {s.chunk: i for i, s in enumerate(steps) if s.kind == "B"}
    sync_microbatch = {steps[i].chunk: steps[i].microbatch for i in last_backward.values()}

    def sync_context(step: Step):
        if run.forward_only or sync_microbatch.get(step.chunk) == step.microbatch:
            return contextlib.nullcontext()
        return run.no_sync_func(run.chunks[step.chunk])

    in_flight: list[tuple[list, torch.Tensor | None]] = []  # (send requests, tensor to free)
    losses = []
    comm = {"tensor_shape": run.tensor_shape, "dtype": run.dtype}
    comm["variable_seq_lengths"] = run.variable_seq_lengths

    def retire(block: bool) -> None:
        keep = []
        for requests, tensor in in_flight:
            if block or all(r.is_completed() for r in requests):
                for r in requests:
                    r.wait()
                if tensor is not None:
                    deallocate_output_tensor(tensor)
            else:
                keep.append((requests, tensor))
        in_flight[:] = keep

    for step in steps:
        chunk = run.chunks[step.chunk]
        if interleaved:
            ps.set_virtual_pipeline_model_parallel_rank(step.chunk)
        first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        if step.kind == "F":
            input_tensor = None if first else communicate(recv_prev=True, **comm)[0]
            set_input = _wrapped_attr(chunk, "set_input_tensor")
            if set_input is not None:
                set_input(input_tensor)
            elif not first:
                raise TypeError(
                    f"pipeline schedule: {type(chunk).__name__} needs a set_input_tensor(tensor) "
                    "method to take the previous stage's activation"
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
            if not last:
                _, _, requests = communicate(tensor_send_next=output, wait=False, **comm)
                in_flight.append((requests, None if run.forward_only else output))
            if not run.forward_only:
                inputs[step.chunk][step.microbatch] = input_tensor
                outputs[step.chunk][step.microbatch] = output
        else:
            grad = None if last else communicate(recv_next=True, **comm)[1]
            input_tensor = inputs[step.chunk].pop(step.microbatch)
            output = outputs[step.chunk].pop(step.microbatch)
            if last and run.grad_scale_func is not None:
                output = run.grad_scale_func(output)
            with sync_context(step):
                custom_backward(output, grad)
            if not first:
                _, _, requests = communicate(tensor_send_prev=input_tensor.grad, wait=False, **comm)
                in_flight.append((requests, None))
        retire(block=False)
    retire(block=True)
    if interleaved:
        ps.set_virtual_pipeline_model_parallel_rank(0)
    return losses


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
        steps = schedule_no_pipelining(num_microbatches, forward_only)
    elif kind == "1f1b":
        steps = schedule_1f1b(num_microbatches, pp, rank, forward_only)
    else:
        steps = schedule_interleaved(num_microbatches, pp, rank, vpp, forward_only)
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
    losses = _execute(run, steps, interleaved=kind == "interleaved")
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
